"""`dvfs cap`: production caps from a headroom decision, applied, shown and reset.

`cap apply` exits 0 when it applied caps and every GPU UUID the file names is here (models a
host lacks are normal in a fleet file: a note), 2 when the file matches no GPU on this host or
holds simulated caps (nothing is changed), 5 when it applied the caps that match but GPU
UUIDs it names are not here (0 with --skip-missing), and 1 when a GPU of the host has fallen
off the bus, once the others that match are capped (--skip-missing or not: the lost GPU needs
seeing to). A dry run exits as the apply would.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from dvfs.cli.common import (
    ExistingPath,
    OutputFile,
    OutputFolder,
    console,
    dry_run_reads_gpus,
    escape,
    handle_errors,
    has_no_twin,
    make_parent,
    show_beside_lost,
    wait_for_driver_option,
    wait_for_the_driver,
)

if TYPE_CHECKING:
    from dvfs.backends import WithheldGpus
    from dvfs.caps import CapAction, CapsFile
    from dvfs.errors import GpuError
    from dvfs.gpu.base import Gpu

#: An error `_naming_lost` names the GPUs fallen off the bus after, its type kept.
E = TypeVar("E", bound=Exception)

state_dir_option = click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs records applied caps "
    "[default: $DVFS_STATE_DIR if set, else /var/lib/dvfs as root, else $XDG_STATE_HOME/dvfs].",
)


@click.group()
def cap() -> None:
    """Put latency-preserving caps on a fleet: plan, apply, show, reset."""


def _once(ctx: click.Context, param: click.Parameter, values: tuple[Any, ...]) -> Any:
    """The one value of an option click collects with `multiple=True` only to see it repeated:
    its last value would otherwise silently win."""
    if len(values) > 1:
        shown = " ".join(f"{param.opts[-1]} {v}" for v in values)
        raise click.BadParameter(
            f"given {len(values)} times ({shown}): {param.opts[-1]} takes one value",
            ctx=ctx,
            param=param,
        )
    return values[0] if values else None


@cap.command("plan")
@click.argument("headroom_json", type=ExistingPath(dir_okay=False))
@click.option(
    "--batch",
    type=int,
    multiple=True,
    callback=_once,
    help="The batch size production runs at (static caps).",
)
@click.option(
    "--per-batch",
    is_flag=True,
    help="Write a per-batch plan for `dvfs govern` (one setting per batch size) instead.",
)
@click.option(
    "--drafter",
    multiple=True,
    callback=_once,
    help="The drafter production serves with [--per-batch: the document's only drafter].",
)
@click.option(
    "--corpus",
    multiple=True,
    callback=_once,
    help="The corpus production serves, or worst-case: per knob the least aggressive choice "
    "across all measured corpora  [default: worst-case].",
)
@click.option(
    "--gpu", "uuids", multiple=True, help="GPU UUIDs to cap [default: the measured GPUs]."
)
@click.option(
    "--model",
    "model_name",
    help="Cap every GPU of this model instead (a fleet): one the document measured, its rows only.",
)
@click.option(
    "-o",
    "--out",
    "out_path",
    type=OutputFile("caps.toml"),
    help="Write the caps file here [default: print it].",
)
@handle_errors
def plan(
    headroom_json: Path,
    batch: int | None,
    per_batch: bool,
    drafter: str | None,
    corpus: str | None,
    uuids: tuple[str, ...],
    model_name: str | None,
    out_path: Path | None,
) -> None:
    """Turn `dvfs headroom --json` output and your choice into a caps file.

    With --per-batch, a plan for `dvfs govern` instead: for each batch size the document has,
    the setting that kept latency within its target at the least energy.
    """
    from dvfs.caps import dump_caps, load_headroom, plan_caps
    from dvfs.outputs import is_stream, write_text

    corpus = corpus or "worst-case"
    if per_batch:
        if batch is not None or uuids or model_name:
            raise click.UsageError(
                "--per-batch plans every batch size for the measured GPU model: it takes no "
                "--batch, --gpu or --model"
            )
        _plan_per_batch(load_headroom(headroom_json), drafter, corpus, out_path)
        return
    if batch is None or drafter is None:
        raise click.UsageError("static caps need --batch and --drafter (or use --per-batch)")
    caps = plan_caps(
        load_headroom(headroom_json),
        batch=batch,
        drafter=drafter,
        corpus=corpus,
        uuids=uuids,
        model_name=model_name,
    )
    text = dump_caps(caps)
    if out_path is not None:  # written before any note: a failed write is its one line
        make_parent(out_path)  # as `dvfs report -o` makes it
        write_text(out_path, text)  # atomically: a failed write keeps the previous file
    err = console(stderr=True)
    if caps.simulated:
        err.print(
            f"[yellow]These caps are simulated: planned from a digital-twin cube "
            f"({escape(str(caps.meta.get('measured_on')))}), not from measurements of real "
            "GPUs; `dvfs cap apply` refuses them unless given --allow-simulated.[/yellow]"
        )
    for note in ("grid_edge", "not_capped", "above_stock"):
        if caps.meta.get(note):
            err.print(f"[yellow]Note: {escape(str(caps.meta[note]))}.[/yellow]")
    if out_path is None:
        click.echo(text, nl=False)
        return
    if is_stream(out_path):  # /dev/stdout, a pipe: no file a later command can read again
        return
    import shlex

    # The command on a line of its own, never wrapped, its path quoted (and not taken for an
    # option, "-caps.toml"): it can be pasted.
    path = str(out_path)
    command = f"dvfs cap apply {shlex.quote('./' + path if path.startswith('-') else path)}"
    command += " --dry-run"
    command += " --allow-simulated" if caps.simulated else ""
    # The dry run matches the file to the GPUs it caps, through their driver: run there.
    err.print(
        f"wrote {escape(str(out_path))}; check it on the host of the GPUs it caps "
        "(the dry run reads them through their driver; it needs no root) with:",
        soft_wrap=True,
    )
    err.print(f"  {escape(command)}", soft_wrap=True, highlight=False)


def _plan_per_batch(doc: Any, drafter: str | None, corpus: str, out_path: Path | None) -> None:
    import tomllib

    from dvfs.caps.planning import plan_per_batch
    from dvfs.govern.plan import dump_plan, parse_plan
    from dvfs.outputs import is_stream, write_text

    plan = plan_per_batch(doc, drafter=drafter, corpus=corpus)
    text = dump_plan(plan)
    # What is written reads back as a plan. The text is checked, not the file read back: as
    # root that read refused a plan written in a user's folder (which `dvfs govern` as root
    # refuses: exit 2 after the file was written), a check of where the plan is followed from.
    parse_plan(tomllib.loads(text), where=str(out_path or "the plan"))
    if out_path is not None:  # written before the steps and notes: a failed write is its one line
        make_parent(out_path)  # as `dvfs report -o` makes it
        write_text(out_path, text)  # atomically: a failed write keeps the previous file
    err = console(stderr=True)
    if plan.simulated:
        err.print(
            f"[yellow]This plan is simulated: planned from a digital-twin cube "
            f"({escape(plan.measured_on)}), not from measurements of real GPUs; `dvfs govern` "
            "refuses it unless given --allow-simulated.[/yellow]"
        )
    for step in plan.steps:
        err.print(f"batch {step.batch}: {escape(step.setting.describe())}")
    for note in ("grid_edge", "within_noise", "saving_unknown", "above_stock"):
        if plan.meta.get(note):
            err.print(f"[yellow]Note: {escape(str(plan.meta[note]))}.[/yellow]")
    err.print(
        f"between two planned batches: the less aggressive of the two; above "
        f"{plan.steps[-1].batch}: stock (not measured)"
    )
    if out_path is None:
        click.echo(text, nl=False)
        return
    if is_stream(out_path):  # /dev/stdout, a pipe: no file `dvfs govern` can read again
        return
    import shlex

    # The command on a line of its own, never wrapped, its path quoted: it can be pasted.
    command = f"dvfs govern --plan {shlex.quote(str(out_path))} --url http://127.0.0.1:30000"
    command += " --dry-run" + (" --allow-simulated" if plan.simulated else "")
    err.print(f"wrote {escape(str(out_path))}; try it with:", soft_wrap=True)
    err.print(f"  {escape(command)}", soft_wrap=True, highlight=False)


@cap.command("apply")
@click.argument("caps_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Print what would change; change nothing.")
@click.option(
    "--skip-missing",
    is_flag=True,
    help="GPU UUIDs in the file that are not here are expected: exit 0, not 5.",
)
@click.option(
    "--allow-simulated",
    is_flag=True,
    help="Apply caps planned from a digital-twin cube, matched by GPU model name.",
)
@wait_for_driver_option("before failing")
@state_dir_option
@handle_errors
@dry_run_reads_gpus(
    "`dvfs cap apply --dry-run`",
    "the GPUs it would cap (which caps match them, what each holds now)",
    refused="dry run, nothing changed: ",
)
def apply(
    caps_file: Path,
    dry_run: bool,
    skip_missing: bool,
    allow_simulated: bool,
    wait_for_driver_s: int,
    state_dir: Path | None,
) -> None:
    """Apply CAPS_FILE: SM clock locks and power limits, by GPU UUID or model (needs root).

    Exits 2 (changing nothing) when the file matches no GPU here, holds simulated caps without
    --allow-simulated, or has a cap a GPU here cannot take (another model's, a clock it does not
    support); 5 when it applied what matches but GPU UUIDs the file names are not here (0 with
    --skip-missing; 4, changing nothing, where NVML counts a GPU this process may not talk to,
    whose UUID a UUID not here may be); 1 naming a GPU fallen off the bus, once the other GPUs
    are capped (or none, if the file matches none of those that open: the lost GPU may be the
    one it names; 4 where NVML also withholds a GPU, which it may name); 4 naming a GPU NVML
    counts but this process may not talk to, where the file has [[model]] entries (its model
    unreadable: one may name it), once the other GPUs are capped (none, if the file matches
    none of them); 3, changing nothing, when another dvfs
    holds a GPU it would cap (naming one fallen off the bus too). Models not on this host, and
    GPUs here that no entry names, are only noted. With --wait-for-driver, a kernel module not
    loaded yet is waited for (the caps unit at boot); nothing else is.
    """
    from dvfs.caps import load_caps
    from dvfs.signals import Interrupted, interrupted_while, signals_raise

    caps = load_caps(caps_file)
    # once the file is read: a file refused is not waited on
    wait_for_the_driver(wait_for_driver_s, dry_run=dry_run)
    # From here until a GPU is changed, a signal (the caps unit stopped: a shutdown while an
    # NVML call at boot hangs) says in one line that nothing was, not exit 143 without a word;
    # once one may be, `_stopped_applying` says what is capped.
    changing: list[bool] = []
    try:
        with signals_raise():
            _apply(caps, caps_file, dry_run, skip_missing, allow_simulated, state_dir, changing)
    except (KeyboardInterrupt, Interrupted) as exc:
        if changing:
            raise
        raise interrupted_while(
            exc, "before any GPU was changed: nothing changed, no cap applied; start it again"
        ) from None


def _apply(
    caps: CapsFile,
    caps_file: Path,
    dry_run: bool,
    skip_missing: bool,
    allow_simulated: bool,
    state_dir: Path | None,
    changing: list[bool],
) -> None:
    """`apply` once the caps file is read and the driver loaded; `changing` is told (True
    appended) once the GPUs may be changed."""
    from dvfs.backends import WithheldGpus, lost_gpus, open_gpus, reachable_gpus
    from dvfs.caps import (
        AppliedCaps,
        CapsPartlyAppliedError,
        enforce_plan,
        plan_actions,
    )
    from dvfs.errors import (
        CapsError,
        CapsRecordError,
        GpuError,
        GpuPermissionError,
        GpuUnavailableError,
    )
    from dvfs.gpu.safety import default_state_dir, records_dir
    from dvfs.signals import Interrupted

    failed: GpuError | None = None  # writes that failed, once the other GPUs are capped
    # A dry run needs no root: it reads the caps in force where root recorded them.
    directory = state_dir or (records_dir() if dry_run else default_state_dir())
    again = _apply_command(caps_file, allow_simulated, state_dir)  # as a user the GPUs admit
    out = console()
    # Every GPU, each opened on its own: one fallen off the bus (at boot, the caps unit) must
    # not leave the others at stock; it is named, exit 1, once they are capped. One whose power
    # limit NVML does not support is set aside only where the file names it (below).
    openable, lost = reachable_gpus(unsupported_ok=True)
    # the GPUs NVML withholds, asked once (where a line needs them), a hung GPU not again
    asked = WithheldGpus(lost)
    if not openable and lost:  # a withheld GPU the file names is said too, as where some open
        line = str(lost_gpus(lost))
        _refuse_unmatched_withheld(
            caps,
            caps_file,
            [],
            allow_simulated,
            asked,
            dry_run=dry_run,
            command=again,
            lost=line,
        )
        raise lost_gpus(lost)
    with open_gpus(openable, allow_mig=True) as opened:  # MIG GPUs: left alone (`plan_actions`)
        _warn_damaged(directory, opened)
        gpus, unsupported = _set_aside_unsupported(caps, opened, allow_simulated)
        gone_line = str(lost_gpus(lost)) if lost else ""  # those that did not open
        lost = sorted([*lost, *unsupported], key=lambda e: (e.index is None, e.index or 0))
        lost_line = str(lost_gpus(lost)) if lost else ""
        try:
            plan = plan_actions(
                caps,
                gpus,
                where=str(caps_file),
                allow_simulated=allow_simulated,
                applied=AppliedCaps(directory).entries_as_written(),  # (damaged: warned of)
                lost=gone_line,
                set_aside=[g for g in opened if g not in gpus],
                directory=directory,
            )
        except (CapsError, GpuUnavailableError):  # matching none here (a GPU lost or not)
            _refuse_unmatched_withheld(
                caps,
                caps_file,
                opened,
                allow_simulated,
                asked,
                dry_run=dry_run,
                command=again,
                lost=lost_line,
            )
            raise
        if plan.unmatched:
            _refuse_withheld(
                plan.unmatched,
                str(caps_file),
                asked,
                dry_run=dry_run,
                lost=lost_line,
                command=again,
            )
        # every GPU leaves out one NVML may not talk to: a [[model]] entry may name it (its
        # model cannot be read), left uncapped, which must not read as the file applied
        withheld = _withheld_models(caps, str(caps_file), asked, dry_run=dry_run, command=again)
        capped = {a.uuid for a in plan.actions if not a.refused}
        volatile = {
            g.identity.uuid: f"GPU {g.identity.index}"
            for g in gpus
            if g.identity.uuid in capped and g.persistence_mode() is False
        }
        if dry_run:
            try:
                _refuse_as_the_apply_would(plan.actions, gpus, directory)
            except (GpuError, CapsRecordError) as exc:
                raise _naming_lost(exc, lost_line) from None
            for action in plan.actions:
                if not action.refused:  # (said below, as the apply fails on it)
                    click.echo(f"dry run, nothing changed: would apply to {action.describe()}")
            doubts = [
                a.power_doubt or a.refused for a in plan.actions if a.power_doubt or a.refused
            ]
            if doubts:  # the apply fails on them, exit 1, once the rest is capped
                failed = GpuError(
                    "dry run, nothing changed: `cap apply` would apply the rest and exit 1: "
                    + "; ".join(doubts)
                )
        else:  # each GPU reported once its caps are in place, not before
            applied: set[str] = set()

            def done(action: CapAction) -> None:
                applied.add(action.uuid)
                click.echo(f"applied to {action.describe()}")

            changing.append(True)
            try:
                enforce_plan(plan, gpus, directory, str(caps_file.resolve()), done)
            except (KeyboardInterrupt, Interrupted) as exc:
                # the caps unit stopped (a shutdown) mid-apply: which GPUs are capped and which
                # not whole said in the line, not "Interrupted" after the GPUs done alone
                raise _stopped_applying(exc, plan.actions, applied, again, directory) from None
            except (GpuError, GpuPermissionError) as exc:
                if type(exc) not in (GpuError, GpuPermissionError):
                    # refused before any change (held by another dvfs: exit 3), with the GPUs
                    # fallen off the bus, which need seeing to all the same
                    raise _naming_lost(exc, lost_line) from None
                # Writes failed on some GPUs, the others capped: a GPU fallen off the bus is
                # still named, beside the failure.
                failed = exc
            except CapsRecordError as exc:
                # The record cannot be written (a full disk): the GPUs withheld and those fallen
                # off the bus are still named, after it, as beside a GPU's failure.
                exc.args = ("; ".join(p for p in (str(exc), withheld, lost_line) if p),)
                raise
            except OSError as exc:
                if applied:  # (said as it is where a GPU is capped already)
                    raise
                # The caps record's lock (or a GPU's) that cannot be opened, before any change:
                # named with the GPUs withheld and fallen off the bus, as a folder there is.
                from dvfs.caps.actuation import state_file_problem
                from dvfs.cli.common import describe_os_error

                problem = state_file_problem(exc)
                said = (
                    f"{problem}, then apply the caps again" if problem else describe_os_error(exc)
                )
                raise CapsRecordError(
                    "; ".join(p for p in (said, withheld, lost_line) if p)
                ) from exc
            else:
                out.print(f"applied caps to {len(plan.actions)} GPU(s)")
            volatile = {u: g for u, g in volatile.items() if u in applied}  # those capped
    where = str(caps_file)
    if volatile:  # the caps are in place now, but the driver may drop them when dvfs exits
        console(stderr=True).print(
            f"[yellow]warning: persistence mode is off on {', '.join(volatile.values())}: the "
            "driver resets clock locks and power limits when it unloads (no process holding the "
            "GPU), so these caps may not last; enable it (nvidia-smi -pm 1, or run "
            "nvidia-persistenced)[/yellow]",
            soft_wrap=True,
        )
    if plan.unused:
        console(stderr=True).print(f"note: {escape(plan.unused_message(where, dry_run=dry_run))}")
    if plan.mig:
        console(stderr=True).print(f"note: {escape(plan.mig_message(dry_run=dry_run))}")
    if plan.untouched:
        from dvfs.gpu.safety import state_dir_command

        def reset_of(indices: str) -> str:
            return state_dir_command(f"dvfs cap reset --applied {indices}", directory)

        console(stderr=True).print(
            f"note: {escape(plan.untouched_message(where, dry_run=dry_run, reset=reset_of))}"
        )
    if plan.unmatched:
        message = plan.unmatched_message(where, dry_run=dry_run)
        if dry_run:
            message = f"dry run, nothing changed: {message}"
        if not skip_missing and not lost and failed is None:
            raise CapsPartlyAppliedError(f"{message}; pass --skip-missing if that is expected")
        console(stderr=True).print(f"note: {escape(message)}")
    if failed is not None:  # once the others' notes are said; with the GPUs fallen off the bus
        raise type(failed)("; ".join(p for p in (str(failed), withheld, lost_line) if p)) from None
    if withheld:  # the others are capped (or, dry run, would be): exit 4, as `cap reset`
        raise GpuPermissionError(
            "; ".join(p for p in (withheld, lost_line) if p)
            + (
                "; `cap apply` would cap the other GPUs the file matches and exit 4"
                if dry_run
                else "; caps were applied to the other GPUs the file matches"
            )
        )
    if lost:  # the others are capped (or, dry run, would be): the lost GPU needs seeing to
        if dry_run:
            raise GpuUnavailableError(
                f"dry run, nothing changed: {lost_line}; `cap apply` would cap the other GPUs "
                "the file matches and exit 1"
            )
        raise GpuUnavailableError(
            f"{lost_line}; caps were applied to the other GPUs the file matches"
        )


def _refuse_withheld(
    unmatched: Sequence[str],
    where: str,
    asked: WithheldGpus,
    *,
    dry_run: bool,
    command: str,
    lost: str = "",
) -> None:
    """Refuse (exit 4, nothing changed) a caps file naming GPU UUIDs none of the GPUs that open
    has, on a host where NVML counts GPUs it has no permission to talk to: "every GPU" leaves
    those out (`dvfs.gpu.nvml.every_gpu`), and their UUIDs cannot be read, so a UUID the file
    names may be one of theirs: a GPU the file names must not be skipped as "not on this host"
    (exit 0 with --skip-missing), but refused as a GPU named on the command line is. `asked`:
    the GPUs NVML withholds, asked once for the command."""
    from dvfs.errors import GpuPermissionError

    refused = asked()
    if not refused:
        return
    gpus = ", ".join(f"GPU {i}" for i in refused)
    raise GpuPermissionError(
        f"{'dry run, nothing changed: ' if dry_run else ''}{where} names GPU(s) "
        f"{', '.join(unmatched)}, which are not among the GPUs this process may talk to; the "
        f"driver does not let it talk to {gpus} (NVML: no permission), not even to read "
        f"{'its' if len(refused) == 1 else 'their'} UUID, so nothing was capped: run "
        f"{command} as a user the GPUs admit (root, with sudo), or remove those entries from "
        "the file" + (f"; {lost}" if lost else "")
    )


def _withheld_models(
    caps: CapsFile, where: str, asked: WithheldGpus, *, dry_run: bool, command: str
) -> str:
    """The line naming the GPUs NVML counts but has no permission to talk to, where the caps
    file has [[model]] entries: every GPU leaves those GPUs out (`dvfs.gpu.nvml.every_gpu`) and
    their model cannot be read, so an entry for every GPU of a model may name one, which is
    not capped, and the `command` that caps it (`_apply_command`); "" where the file names
    GPUs by UUID only or NVML withholds none. `asked`: the GPUs NVML withholds, asked once."""
    models = [c.name for c in caps.caps if c.name]
    if not models:
        return ""
    refused = asked()
    if not refused:
        return ""
    gpus = ", ".join(f"GPU {i}" for i in refused)
    one = len(refused) == 1
    return (
        f"{'dry run, nothing changed: ' if dry_run else ''}the driver does not let this process "
        f"talk to {gpus} (NVML: no permission), not even to read {'its' if one else 'their'} "
        f"model, so {where}'s [[model]] entries ({', '.join(dict.fromkeys(models))}) may name "
        f"{'it' if one else 'them'}: {'it' if one else 'they'} "
        f"{'would not be' if dry_run else 'was not' if one else 'were not'} capped; run "
        f"{command} as a user the GPUs admit (root, with sudo), or name the GPUs to cap by UUID "
        "([[gpu]] entries)"
    )


def _stopped_applying(
    exc: BaseException,
    actions: Sequence[CapAction],
    applied: set[str],
    again: str,
    directory: Path,
) -> BaseException:
    """The line of a `cap apply` a signal stopped (SIGTERM: the caps unit's stop at shutdown)
    while it changed the GPUs: those capped whole, and those not (untouched, or a knob in place
    and dvfs's caps record listing it), with what finishes or undoes it. A signal given up on
    mid-restore (`RestoreAbandoned`) says its own."""
    from dvfs.gpu.safety import state_dir_command
    from dvfs.signals import RestoreAbandoned, interrupted_while

    if isinstance(exc, RestoreAbandoned):
        return exc
    capped = [a for a in actions if not a.refused]
    done = [f"GPU {a.index}" for a in capped if a.uuid in applied]
    rest = [f"GPU {a.index}" for a in capped if a.uuid not in applied]
    undo = state_dir_command("dvfs cap reset --applied", directory)
    show = state_dir_command("dvfs cap show", directory)
    return interrupted_while(
        exc,
        "while applying the caps: "
        f"{'caps applied to ' + ', '.join(done) if done else 'no GPU capped whole'}; "
        f"{', '.join(rest) or 'none'} not capped, or only in part (dvfs's caps record lists "
        f"what each holds: `{show}`); `{again}` applies the rest, `{undo}` takes them off",
    )


def _apply_command(caps_file: Path, allow_simulated: bool, state_dir: Path | None) -> str:
    """The `dvfs cap apply` that applies `caps_file` as this one would, to paste as a user the
    GPUs admit: the file (quoted), --allow-simulated where given, and the --state-dir its
    caps record is in where a plain command run with sudo would look elsewhere
    (`state_dir_command`)."""
    import shlex

    from dvfs.gpu.safety import default_state_dir, state_dir_command

    path = str(caps_file)  # quoted, and not taken for an option ("-caps.toml"), as `cap plan`'s
    command = f"dvfs cap apply {shlex.quote('./' + path if path.startswith('-') else path)}"
    command += " --allow-simulated" if allow_simulated else ""
    return state_dir_command(command, state_dir or default_state_dir())


def _refuse_unmatched_withheld(
    caps: CapsFile,
    caps_file: Path,
    opened: Sequence[Gpu],
    allow_simulated: bool,
    asked: WithheldGpus,
    *,
    dry_run: bool,
    command: str,
    lost: str = "",
) -> None:
    """Where the caps file matches none of the GPUs that open (refused as a file for another
    host, exit 2, or where a GPU fell off the bus as one that may be it, exit 1, `lost`
    naming those GPUs), refuse it instead (exit 4, nothing capped) in the line naming the GPUs NVML
    counts but this process may not talk to, whose model a [[model]] entry, or whose UUID a
    [[gpu]] entry, may be (`_refuse_withheld`, as where the file matches others too): "no
    GPU on this host" would be untrue of them. Nothing where the file is refused as
    simulated."""
    from dvfs.errors import GpuPermissionError

    if caps.simulated and not allow_simulated:
        return
    named = (
        caps.for_gpu(g.identity.uuid, g.identity.name, twin_models=allow_simulated) for g in opened
    )
    if any(cap is not None for cap in named):
        return
    withheld = _withheld_models(caps, str(caps_file), asked, dry_run=dry_run, command=command)
    if withheld:
        host = "; ".join(f"GPU {g.identity.index}, {g.identity.name}" for g in opened) or "none"
        raise GpuPermissionError(
            f"{withheld}; {caps_file} matches none of the GPUs this process may talk to "
            f"({host}), so nothing {'would be' if dry_run else 'was'} capped"
            + (f"; {lost}" if lost else "")
        ) from None
    uuids = [c.uuid for c in caps.caps if c.uuid]
    if uuids:
        _refuse_withheld(uuids, str(caps_file), asked, dry_run=dry_run, command=command, lost=lost)


def _set_aside_unsupported(
    caps: CapsFile, gpus: Sequence[Gpu], allow_simulated: bool
) -> tuple[list[Gpu], list[GpuError]]:
    """`gpus` but those whose entry in the caps file sets a power limit NVML does not support
    on them (named, exit 1, once the others are capped), and their errors. One the file does
    not name stays: it is left as it is, with a note, as any GPU no entry names (set aside, it
    failed every apply, the caps unit at each boot); so does one whose entry caps only its SM
    clock, which is locked without reading or recording a power limit."""
    from dvfs.errors import GpuNotSupportedError

    kept: list[Gpu] = []
    unsupported: list[GpuError] = []
    for gpu in gpus:
        ident = gpu.identity
        cap = caps.for_gpu(ident.uuid, ident.name, twin_models=allow_simulated)
        if cap is not None and cap.power_limit_w is not None:
            try:
                gpu.power_limit_mw()
            except GpuNotSupportedError as exc:
                exc.index, exc.uuid = ident.index, None
                unsupported.append(exc)
                continue
        kept.append(gpu)
    return kept, unsupported


def _naming_lost(exc: E, lost_line: str) -> E:
    """`exc` (its type, exit code and attributes kept) followed by `lost_line`, the GPUs
    fallen off the bus (`lost_gpus`), where there are any."""
    if lost_line:
        exc.args = (f"{exc}; {lost_line}",)
    return exc


def _refuse_as_the_apply_would(
    actions: Sequence[CapAction], gpus: Sequence[Gpu], directory: Path
) -> None:
    """A dry run exits as the apply would: refused (exit 3) for a GPU another dvfs holds or
    one holding an earlier run's unrestored changes, and (exit 1) for a folder in the place of
    the caps record's lock or a state folder the apply cannot write (read-only, full,
    immutable), read without taking or changing anything."""
    from dvfs.caps import AppliedCaps
    from dvfs.caps.actuation import state_file_problem
    from dvfs.cli.common import describe_os_error
    from dvfs.errors import CapsRecordError, GpuLockFileError, GpuStateError
    from dvfs.gpu.safety import GpuLocks, StateStore, state_folder_unwritable

    wanted = {a.uuid for a in actions}
    targets = [g for g in gpus if g.identity.uuid in wanted]
    prefix = "dry run, nothing changed: the apply would be refused: "
    locks = GpuLocks(directory)
    for gpu in targets:
        not_a_lock = locks.not_a_lock(gpu)  # no dvfs holds it: a fault of the folder, exit 1
        if not_a_lock:
            raise GpuLockFileError(prefix + not_a_lock)
        busy = locks.holder(gpu)
        if busy:
            raise GpuStateError(prefix + busy)
    try:
        StateStore(directory).refuse_if_pending(targets, drop_rebooted=False)
    except GpuStateError as exc:
        raise GpuStateError(prefix + str(exc)) from exc
    if actions:  # as `apply_actions` refuses it, before any GPU is changed
        record = AppliedCaps(directory)
        try:
            record.refuse_a_folder_lock()
        except CapsRecordError as exc:
            raise CapsRecordError(prefix + str(exc)) from exc
        except OSError as exc:  # in the apply's words (`describe_os_error`)
            raise CapsRecordError(prefix + describe_os_error(exc)) from exc
        # A state folder the apply cannot write (read-only, full, immutable) fails it, exit 1,
        # before any GPU is capped: said so, with the apply's way on
        files = [
            *(directory / f"{g.identity.uuid}.lock" for g in targets),
            record.path,
            record.path.with_name(f"{record.path.name}.lock"),
        ]
        unwritable = state_folder_unwritable(directory, files)
        if unwritable is not None:
            line = state_file_problem(unwritable) or describe_os_error(unwritable)
            raise CapsRecordError(f"{prefix}{line}, then apply the caps again")


@cap.command("show")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON: a list of one object per GPU (power limits, clock lock, caps source).",
)
@click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs recorded the caps it applied [default: $DVFS_STATE_DIR if set, else "
    "/var/lib/dvfs as root; else $XDG_STATE_HOME/dvfs if it holds a record, else "
    "/var/lib/dvfs, where root applied them].",
)
@handle_errors
@has_no_twin
def show(as_json: bool, state_dir: Path | None) -> None:
    """What is enforced now: power limits (read from NVML), and clock locks dvfs applied
    (a running governor's, else `cap apply`'s). A GPU fallen off the bus is named, exit 1,
    after the others are shown. Where NVML counts a GPU it has no permission to talk to
    (left out of every GPU), caps dvfs recorded for none of the GPUs shown are named in a
    warning line: they may be that GPU's, in force."""
    from dvfs.backends import open_gpus, reachable_gpus, withheld_caps_line
    from dvfs.caps import AppliedCaps, GovernorLocks, caps_status
    from dvfs.gpu.safety import records_dir, state_dir_command

    # one lost GPU must not hide the others' caps, nor one that cannot read what is shown
    openable, lost = reachable_gpus(shown=True)
    rows: list[dict[str, Any]] = []
    withheld = ""
    if openable or not lost:
        directory = state_dir or records_dir()
        with open_gpus(openable, allow_mig=True) as gpus:
            _warn_damaged(directory, gpus)
            # a lock or limit outside the GPU's range (a hand edit), which sweeps and `dvfs
            # govern` refuse as damaged: it was shown as dvfs's cap, with no word of that
            for line in AppliedCaps(directory).outside_lines(gpus):
                click.echo(f"warning: {line}", err=True)  # one line, unwrapped
            for line in GovernorLocks(directory).outside_lines(gpus):  # (and a governor's)
                click.echo(f"warning: {line}", err=True)
            rows = caps_status(gpus, directory)
            # every GPU leaves out one NVML may not talk to: caps recorded for none of those
            # shown may be its, in force, which must not read as no caps there
            withheld = withheld_caps_line(
                directory,
                gpus,
                "they are not shown",
                state_dir_command("dvfs cap show", directory),
                lost,
            )
    if withheld:
        click.echo(f"warning: {withheld}", err=True)  # one line, unwrapped
    show_beside_lost(rows, lost, as_json=as_json, show=_print_caps_status)


def _print_caps_status(rows: Sequence[dict[str, Any]]) -> None:
    """`cap show`'s line per GPU, from `caps_status`'s rows."""
    out = console()
    for r in rows:
        lock = (
            f"locked {r['sm_clock_lock_mhz'][0]}-{r['sm_clock_lock_mhz'][1]} MHz by "
            f"{escape(r['sm_clock_lock_set_by'])} (dvfs record)"  # (a record's pid and time
            if r["sm_clock_lock_mhz"]  # as written, text: "[/x]" is no markup)
            else f"locked by {escape(r['sm_clock_lock_set_by'])}"
            if r["sm_clock_lock_set_by"]  # (a damaged record's lock: unknown)
            else "no dvfs clock lock"
        )
        static = r["caps_sm_clock_lock_mhz"]
        if r["sm_clock_lock_mhz"] and r["sm_clock_lock_mhz"] != static:
            lock += (
                f", under the static cap {static[0]}-{static[1]} MHz"
                if static
                else ", no static clock cap"
            )
        source = (  # (text, as written: a hand-edited record's number or list too)
            f", from {escape(str(r['caps_source']))}"
            + ("" if r["applied"] is None else f" at {escape(str(r['applied']))}")
            if r["caps_source"]
            else ""
        )  # (no time where the entry has none: a hand edit, never "at None")
        default = r["default_power_limit_w"]
        power = f"power limit {r['enforced_power_limit_w']:g} W" + (
            " enforced (NVML does not support setting it on this GPU)"
            if default is None
            else f" (default {default:g} W)"
        )
        out.print(
            f"GPU {r['index']} ({r['uuid']}): {power}, {lock}, SM clock now "
            f"{r['sm_clock_mhz']} MHz{source}"
        )


@cap.command("reset")
@click.argument("devices", nargs=-1)
@click.option(
    "--applied",
    is_flag=True,
    help="Reset only what dvfs's caps record says `dvfs cap apply` set (the caps unit's stop): "
    "GPUs it lists no caps for are left as they are, and on the others a clock lock or power "
    "limit it did not set (an operator's, with nvidia-smi) is left be; a power limit it set "
    "goes back to the one it replaced.",
)
@state_dir_option
@handle_errors
@has_no_twin
def reset(devices: tuple[str, ...], applied: bool, state_dir: Path | None) -> None:
    """Unlock SM clocks and restore default power limits on DEVICES (all GPUs if none; with
    --applied, only what `cap apply` set, by dvfs's caps record). A GPU
    fallen off the bus (named or not) is named, exit 1, once the others are reset; a GPU
    another dvfs process holds (a running `dvfs govern`) is left to it and named, exit 3,
    once the others are reset. With no DEVICES (nor CUDA_VISIBLE_DEVICES), where NVML counts a
    GPU it has no permission to talk to, caps dvfs recorded for none of the GPUs reset are
    named, exit 4, once the others are reset: they may be that GPU's."""
    from dvfs.backends import job_gpus, lost_gpus, open_gpus, parse_devices, reachable_gpus
    from dvfs.caps import reset_locked
    from dvfs.errors import CapsRecordError, GpuLockFileError, GpuPermissionError, GpuStateError
    from dvfs.gpu.safety import default_state_dir, state_dir_command, state_dir_flag

    visible = job_gpus("`dvfs cap reset {spaced}`")
    # Every GPU (the job's) or those named: one fallen off the bus must not keep the others
    # capped; it is named once they are reset.
    # (a power limit NVML does not support is no loss: its clocks are reset, the limit left be)
    named, lost = reachable_gpus(visible, devices=parse_devices(devices), unsupported_ok=True)
    if not named and lost:
        raise lost_gpus(lost)
    # Every GPU: those with MIG enabled are left alone, as `cap apply` never caps them; one
    # named here is refused, saying so, not with the sweep's "choose another GPU".
    # (opened side by side; one that began hanging or fell off the bus since it was probed is
    # named with those lost, the others reset)
    with open_gpus(named, visible=visible, allow_mig=True, lost=lost) as found:
        gpus = _without_mig(found)
        if devices and len(gpus) < len(found):
            raise _named_mig([g for g in found if g not in gpus], state_dir or default_state_dir())
        # A GPU that fails is named once the others are reset, with those held and lost.
        directory = state_dir or default_state_dir()
        flag = ["--applied"] if applied else []
        kept: list[Gpu] = []
        _warn_damaged(directory, found)  # (a damaged knob: what the reset does with it)
        if applied:  # only the GPUs the record lists caps on: the others are not dvfs's
            capped = _recorded_capped(directory)
            kept = [g for g in gpus if g.identity.uuid not in capped]
            gpus = [g for g in gpus if g.identity.uuid in capped]
        try:
            # the reset to run again, as typed: without its DEVICES, every GPU's caps go
            again = shlex.join(["dvfs", "cap", "reset", *flag, *devices])
            lines, busy, failed = reset_locked(gpus, directory, again, applied_only=applied)
        except (CapsRecordError, GpuStateError, GpuLockFileError) as exc:  # a lock refused
            if lost:  # the GPUs fallen off the bus need seeing to all the same
                exc.args = (f"{exc}; {lost_gpus(lost)}",)
            raise
        mig = [
            f"GPU {g.identity.index} ({g.identity.uuid})"
            for g in found
            if g not in gpus and g not in kept
        ]
    for line in lines:  # a state file's path named in it: text, not markup, one line each
        console().print(escape(line), soft_wrap=True)
    if kept:
        one = len(kept) == 1
        console(stderr=True).print(
            escape(
                f"note: {', '.join(f'GPU {g.identity.index} ({g.identity.uuid})' for g in kept)} "
                f"{'holds' if one else 'hold'} no caps dvfs's caps record lists: left as "
                f"{'it is' if one else 'they are'} (`dvfs cap reset"
                f"{state_dir_flag(directory)} {' '.join(str(g.identity.index) for g in kept)}` "
                "resets every knob)"
            ),
            soft_wrap=True,
        )
        dead = _dead_runs_gpus(kept, directory)
        if dead:  # a killed sweep's or governor's changes, which the caps record never lists
            numbers = " ".join(str(g.identity.index) for g in dead)
            console(stderr=True).print(
                escape(
                    f"note: {', '.join(f'GPU {g.identity.index}' for g in dead)} "
                    f"{'holds' if len(dead) == 1 else 'hold'} a state file a dead dvfs run "
                    f"left: `{state_dir_command(f'dvfs gpu reset {numbers}', directory)}` puts "
                    "back the settings that run found"
                ),
                soft_wrap=True,
            )
    if mig:
        console(stderr=True).print(
            f"note: {', '.join(mig)} {'has' if len(mig) == 1 else 'have'} MIG enabled and "
            f"{'was' if len(mig) == 1 else 'were'} left alone (dvfs caps whole GPUs only)"
        )
    held = ""
    if busy:  # after the others are reset: one held GPU must not keep every other capped
        one = len(busy) == 1
        who = ", ".join(
            f"GPU {g.identity.index} ({g.identity.uuid}, pid {exc.pid})" for g, exc in busy
        )
        numbers = " ".join(str(g.identity.index) for g, _ in busy)
        held = (
            f"{who} {'is' if one else 'are'} in use by another dvfs process and "
            f"{'was' if one else 'were'} not reset (a running `dvfs govern` puts back the caps "
            f"it found when it stops): stop it, then "
            f"`dvfs cap reset{' --applied' if applied else ''}{state_dir_flag(directory)} "
            f"{numbers}`"
        )
    lost_too = str(lost_gpus(lost)) if lost else ""
    # every GPU leaves out one NVML may not talk to: caps recorded for none of those found may
    # be its, left in force, which must not read as every GPU reset
    withheld = "" if devices or visible else _withheld_caps(directory, found, lost)
    if failed:
        if not held and not lost and not withheld:
            raise failed
        # (a bug's cause kept: its traceback, with -vv, as where nothing is joined to it)
        joined = "; ".join(p for p in (str(failed), held, withheld, lost_too) if p)
        raise type(failed)(joined) from failed.__cause__
    if held:
        raise GpuStateError("; ".join(p for p in (held, withheld, lost_too) if p))
    if withheld:
        raise GpuPermissionError("; ".join(p for p in (withheld, lost_too) if p))
    if lost:
        raise lost_gpus(lost)


def _without_mig(gpus: Sequence[Gpu]) -> list[Gpu]:
    """Those of `gpus` without MIG enabled, in order, `cap reset`'s to reset. Read side by
    side (`side_by_side`, each GPU's call on its own NVML worker): one after another, each GPU
    whose driver hangs cost a deadline before any GPU was reset, and one read's overrun failed
    the whole reset, every GPU left capped. A GPU whose mode cannot be read is kept: its reset
    (whose calls then fail at once) names it, once the others are reset."""
    import contextlib

    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import side_by_side

    def mig(gpu: Gpu) -> bool:
        try:
            return gpu.mig_enabled()
        except GpuError:
            return False

    asked = side_by_side(gpus, mig, named=lambda gpu: f"mig-gpu{gpu.identity.index}")
    enabled: dict[int, bool] = {}
    with contextlib.closing(asked) as finishing:
        for gpu, answer in finishing:
            enabled[id(gpu)] = answer
    return [g for g in gpus if not enabled[id(g)]]


def _warn_damaged(directory: Path, gpus: Sequence[Gpu]) -> None:
    """A warning line for each GPU whose caps record entry names a damaged limit that dvfs's
    cap replaced (`AppliedCaps.damaged_lines`): the record is honoured for the rest."""
    from dvfs.caps import AppliedCaps

    index = {g.identity.uuid: g.identity.index for g in gpus}
    for line in AppliedCaps(directory).damaged_lines(index):
        click.echo(f"warning: {line}", err=True)  # one line, unwrapped


def _dead_runs_gpus(gpus: Sequence[Gpu], directory: Path) -> list[Gpu]:
    """Those of `gpus` a dead dvfs run (a sweep or governor killed) left a state file on this
    boot, in `directory`: `cap reset --applied` leaves them (no caps record entry), and only
    `dvfs gpu reset` puts back what that run found."""
    from dvfs.caps.actuation import dead_run_left
    from dvfs.gpu.safety import StateStore

    store = StateStore(directory)
    return [g for g in gpus if dead_run_left(store, g.identity.uuid)]


def _recorded_capped(directory: Path) -> set[str]:
    """The UUIDs of the GPUs dvfs's caps record lists a clock lock or power limit on, in force
    this boot (`cap reset --applied`); a record that cannot be read tells none, so nothing is
    reset."""
    from dvfs.caps import AppliedCaps
    from dvfs.caps.actuation import record_fix
    from dvfs.errors import CapsError, CapsRecordError
    from dvfs.gpu.safety import state_dir_flag

    try:
        entries = AppliedCaps(directory).entries_as_written()
    except CapsError as exc:
        told = str(exc).removesuffix(record_fix(directory))
        raise CapsRecordError(
            f"{told}; it is what says what `dvfs cap apply` set, so nothing was reset: remove "
            f"it, then reset every GPU with `dvfs cap reset{state_dir_flag(directory)}`"
        ) from exc
    return {  # (a damaged value is a knob dvfs set all the same: `_spoiled_knobs`)
        uuid
        for uuid, entry in entries.items()
        if entry.get("lock_mhz") is not None or entry.get("power_limit_mw") is not None
    }


def _named_mig(mig: Sequence[Gpu], directory: Path) -> Exception:
    """The refusal of `cap reset N` naming GPUs with MIG enabled, which `cap apply` never caps
    (dvfs caps whole GPUs) and `cap reset` leaves alone: said so, with the `dvfs gpu reset
    --defaults N` that puts back their defaults all the same, not the sweep's "choose another
    GPU"."""
    from dvfs.errors import GpuMigError
    from dvfs.gpu.safety import state_dir_flag

    one = len(mig) == 1
    named = ", ".join(f"GPU {g.identity.index} ({g.identity.uuid})" for g in mig)
    numbers = " ".join(str(g.identity.index) for g in mig)
    return GpuMigError(
        f"{named} {'has' if one else 'have'} MIG enabled: `dvfs cap apply` never caps a GPU "
        f"with MIG enabled (dvfs caps whole GPUs only), so `dvfs cap reset` leaves "
        f"{'it' if one else 'them'} alone, and reset no GPU; to put "
        f"{'its' if one else 'their'} SM clocks and power limit back to the defaults, run "
        f"`dvfs gpu reset --defaults{state_dir_flag(directory)} {numbers}`"
    )


def _withheld_caps(directory: Path, found: Sequence[Gpu], lost: Sequence[GpuError]) -> str:
    """The line naming the GPUs dvfs's caps record holds caps for that none of `found` (every
    GPU) is, where NVML counts GPUs it has no permission to talk to (every GPU leaves them out,
    their UUIDs unreadable: such caps may be one's); "" where there are none."""
    from dvfs.backends import withheld_caps_line
    from dvfs.gpu.safety import state_dir_flag

    # (run with sudo, which drops $DVFS_STATE_DIR: the folder is named where not the default)
    command = f"dvfs cap reset{state_dir_flag(directory)}"
    return withheld_caps_line(directory, found, "those caps were not reset", command, lost)
