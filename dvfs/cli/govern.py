"""`dvfs govern` (load-following caps for a running SGLang server) and `dvfs monitor` (live
power, clocks and energy per token, read-only), both exporting Prometheus text on a port.

`govern` exits 0 after --max-intervals, 1 for a dry run whose server does not answer at the
start (nothing to preview), a GPU fallen off the bus (with no --gpu: it governs none) or a
governed GPU that stops answering NVML (the others put back), 2 for a bad plan or one this
host's GPUs cannot follow or a --gpu not on this host, 3 when a GPU holds unrestored changes
or another dvfs uses it, 4 without permission (with no --gpu, a GPU NVML counts but may not
talk to too: it governs none), and 130/143/129 on SIGINT/SIGTERM/SIGHUP, every GPU
restored first.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import (
    OutputFolder,
    dry_run_reads_gpus,
    handle_errors,
    has_no_twin,
    option_given,
    wait_for_driver_option,
    wait_for_the_driver,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")
#: An interval or dwell beyond a day is a typo; far beyond, the waits overflow the platform's
#: time_t.
LONGEST_DURATION_S = 86_400.0


class Duration(click.ParamType):
    """A time span: 500ms, 1s, 1.5 (seconds), 2m."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        match = _DURATION.match(str(value))
        if not match:
            self.fail(f"{value!r} is not a duration such as 500ms, 1s or 2m", param, ctx)
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
        seconds = float(match.group(1)) * scale
        if not seconds <= LONGEST_DURATION_S:  # inf too: the clocks' waits cannot take it
            self.fail(f"{value!r} is longer than a day, the longest span taken", param, ctx)
        return seconds


def note(message: str) -> None:
    """Every change and every server outage, one timestamped line on stderr (the journal)."""
    click.echo(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} dvfs: {message}", err=True)


gpu_option = click.option(
    "--gpu",
    "devices",
    multiple=True,
    help="GPU index or UUID the server runs on (repeatable) [default: every GPU; only those the "
    "local server at --url is found on (NVML's compute processes) count in its energy per token].",
)
url_option = click.option(
    "--url",
    default="http://127.0.0.1:30000",
    show_default=True,
    help="The SGLang server (started with --enable-metrics); its /metrics is read.",
)
interval_option = click.option(
    "--interval",
    type=Duration(),
    default="1s",
    show_default=True,
    help="How often to read the server and the GPUs.",
)


def listen_option(default: str, more: str = "") -> Any:
    return click.option(
        "--listen",
        default=default,
        metavar="HOST:PORT",
        show_default=True,
        help=f"Serve Prometheus metrics on HOST:PORT (port 0: any free port), or off{more}.",
    )


def max_intervals_option(what: str) -> Any:
    return click.option(
        "--max-intervals",
        type=click.IntRange(min=1),
        metavar="N",
        help=f"Stop after N intervals{what} [default: run until stopped].",
    )


def _refuse_withheld(openable: Sequence[int | str]) -> None:
    """Refuse (exit 4, nothing changed) governing every GPU where NVML counts GPUs it has no
    permission to talk to: every GPU leaves those out (`dvfs.gpu.nvml.every_gpu`), but the
    server may span them, and governing the rest would govern other GPUs than meant, as with
    a GPU fallen off the bus; --gpu names them if intended."""
    from dvfs.backends import withheld_gpus
    from dvfs.errors import GpuPermissionError

    refused = withheld_gpus()
    if refused:
        withheld = ", ".join(f"GPU {i}" for i in refused)
        others = ", ".join(f"GPU {i}" for i in openable) or "none"
        raise GpuPermissionError(
            f"the driver does not let this process talk to {withheld} (NVML: no permission); "
            "`dvfs govern` with no --gpu governs every GPU, so it governs none while one is "
            "withheld: run it as a user the GPUs admit (root, with sudo), or name the GPUs the "
            f"server runs on with --gpu (those it may talk to: {others})"
        )


def _listen_address(listen: str) -> tuple[str, int] | None:
    """--listen checked before any GPU is opened: a usage error, exit 2."""
    from dvfs.govern.exporter import ExporterError, parse_listen

    try:
        return parse_listen(listen)
    except ExporterError as exc:
        raise click.BadParameter(str(exc).removeprefix("--listen "), param_hint="--listen") from exc


def _check_url(url: str) -> None:
    from dvfs.govern.metrics import check_url

    problem = check_url(url)
    if problem:
        raise click.BadParameter(problem, param_hint="--url")


@contextmanager
def _exporting(address: tuple[str, int] | None, live: Any) -> Iterator[None]:
    from dvfs.govern.exporter import start_exporter

    if address is None:
        yield
        return
    exporter = start_exporter(live, *address)
    note(f"serving metrics on {exporter.url}")
    try:
        yield
    finally:
        exporter.close()


@contextmanager
def _stopped_before_governing(governing: list[bool]) -> Iterator[None]:
    """Signals raise within the block (`signals_raise`); one that comes before the governor
    may change a GPU (`governing` still empty: the GPUs opened, the plan checked, at boot an
    NVML call that hangs) ends it in one line saying nothing was changed, as `cap apply`'s
    does, not exit 143 without a word in the journal."""
    from dvfs.signals import Interrupted, interrupted_while, signals_raise

    try:
        with signals_raise():
            yield
    except (KeyboardInterrupt, Interrupted) as exc:
        if governing:
            raise
        raise interrupted_while(
            exc, "before any GPU was changed: nothing changed, no GPU governed; start it again"
        ) from None


@contextmanager
def _told_when_stopped(dry_run: bool, governing: list[bool]) -> Iterator[None]:
    """A governor stopped by a signal (`systemctl stop`: SIGTERM) has put every GPU back by the
    time the signal's exception gets here (a restore that failed, or that a second signal
    abandoned, ends in another error, which says so): its log says it, as after
    --max-intervals. Before it governs (`governing` empty) `_stopped_before_governing` says
    what the signal left."""
    from dvfs.signals import Interrupted, RestoreAbandoned

    try:
        yield
    except (KeyboardInterrupt, Interrupted) as exc:
        if governing and not dry_run and not isinstance(exc, RestoreAbandoned):
            why = "received SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
            note(f"stopped ({why}); GPU settings restored")
        raise


#: The longest a read of the server's /metrics may take: an --interval's read gets its
#: interval (0.5 s at least), up to this; a dry run's first read, which decides whether there
#: is a server to preview at all, gets this whole: a server slow to answer (a loaded machine)
#: is not one that does not answer.
LONGEST_READ_S = 5.0


def _timeout(interval: float) -> float:
    return min(LONGEST_READ_S, max(0.5, interval))


@click.command()
@click.option(
    "--plan",
    "plan_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The per-batch plan from `dvfs cap plan HEADROOM_JSON --per-batch`.",
)
@url_option
@gpu_option
@interval_option
@click.option(
    "--dwell",
    type=Duration(),
    default="10s",
    show_default=True,
    help="Least time from a change to the next, unless the running batch needs a looser "
    "setting than the one in force (that comes at once).",
)
@click.option(
    "--hysteresis",
    type=float,
    default=0.25,
    show_default=True,
    help="Band around the running batch, this fraction of it (at least 1 request) either way: "
    "its least aggressive setting applies, and nothing changes while the batch stays inside.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print what would change; change nothing (exit 1 if the server does not answer "
    f"within {LONGEST_READ_S:g} s).",
)
@click.option(
    "--allow-simulated",
    is_flag=True,
    help="Follow a plan made from a digital-twin cube (matched by GPU model name).",
)
@listen_option("127.0.0.1:9435", " (a --dry-run serves none unless given it)")
@max_intervals_option(", restoring the GPUs")
@click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs keeps state files and locks "
    "[default: $DVFS_STATE_DIR if set, else /var/lib/dvfs as root, else $XDG_STATE_HOME/dvfs].",
)
@wait_for_driver_option("before failing (a dry run does not wait)")
@handle_errors
@dry_run_reads_gpus(
    "`dvfs govern --dry-run`", "the GPUs it would govern (what each holds now, the plan's fit)"
)
def govern(
    plan_path: Path,
    url: str,
    devices: tuple[str, ...],
    interval: float,
    dwell: float,
    hysteresis: float,
    dry_run: bool,
    allow_simulated: bool,
    listen: str,
    max_intervals: int | None,
    state_dir: Path | None,
    wait_for_driver_s: int,
) -> None:
    """Follow the server's load with the plan's per-batch settings (needs root unless --dry-run).

    Every INTERVAL reads the running requests from the server's /metrics; when the batch leaves
    the band in force, takes a new band around it (--hysteresis) and applies the plan's least
    aggressive setting over it (stock when the server has not answered for 5 s; a read that
    fails sooner keeps the setting in force at an INTERVAL under 5 s), under the same safety
    layer as `dvfs cap apply`. A batch the setting in force does not cover gets a looser one
    at once; any other change waits until --dwell after the last. The static caps in force at
    start are a ceiling no step goes above, and what "stock" means. Stopping restores every GPU.
    A GPU fallen off the bus is refused, exit 1, with --gpu or not: none is governed. A governed
    GPU that stops answering NVML stops the governor, exit 1, the others put back. With no
    --gpu, energy per token counts the GPUs the server is found on, as in `dvfs monitor`.
    """
    from dvfs.backends import job_gpus, lost_gpus, open_gpus, parse_devices, reachable_gpus
    from dvfs.errors import GpuUnavailableError
    from dvfs.govern.exporter import LiveMetrics
    from dvfs.govern.loop import Ticker, check_plan_against, check_server_for_dry_run
    from dvfs.govern.loop import govern as run_governor
    from dvfs.govern.metrics import ServerReader
    from dvfs.govern.plan import load_plan
    from dvfs.govern.policy import PolicyParams
    from dvfs.govern.servergpus import ServerGpus
    from dvfs.gpu.base import gpu_names
    from dvfs.gpu.safety import default_state_dir, records_dir
    from dvfs.redact import redact_url

    if interval <= 0:
        raise click.BadParameter("must be more than 0", param_hint="--interval")
    if dry_run and not option_given(click.get_current_context(), "listen"):
        # A preview needs no metrics port: the default one is the running governor's
        # (dvfs-govern.service), and taking it would fail "Address already in use".
        listen = "off"
    address = _listen_address(listen)
    _check_url(url)
    try:
        plan = load_plan(plan_path)
    except OSError as exc:  # a link loop, a folder this user may not search: with what to do
        from dvfs.cli.common import describe_os_error
        from dvfs.errors import CapsError

        raise CapsError(f"per-batch plan: {describe_os_error(exc)}") from exc
    # once the plan is read: a plan refused is not waited on; a dry run waits for nothing
    wait_for_the_driver(0 if dry_run else wait_for_driver_s, nothing="no GPU governed")
    # From here until the governor may change a GPU, a signal (the governor unit stopped: a
    # shutdown while an NVML call at boot hangs) says in one line that nothing was, not
    # exit 143 without a word; once it may, `_told_when_stopped` says the GPUs are back.
    governing: list[bool] = []
    with _stopped_before_governing(governing):
        params = PolicyParams(dwell_s=dwell, hysteresis=hysteresis)
        live = LiveMetrics()
        visible = job_gpus("--gpu with {listed}")
        if not devices:
            # Every GPU is the server's: a server spanning a lost GPU is broken, and governing
            # the rest would silently govern GPUs other than those meant; --gpu names them if
            # intended. (a power limit NVML does not support is no loss: a plan that needs one
            # is refused with the step and the GPU, `check_plan_against`)
            openable, lost = reachable_gpus(visible, unsupported_ok=True)
            if lost:
                others = ", ".join(f"GPU {i}" for i in openable) or "none"
                raise GpuUnavailableError(
                    f"{lost_gpus(lost)}; `dvfs govern` with no --gpu governs every GPU, so "
                    "it governs none while one does not open: name the GPUs the server runs on "
                    f"with --gpu (those that open: {others})"
                )
            if visible is None:
                _refuse_withheld(openable)
        # A dry run (no root needed) reads the static caps where root recorded them.
        records = state_dir or (records_dir() if dry_run else default_state_dir())
        with (
            _told_when_stopped(dry_run, governing),
            ServerReader(url, _timeout(interval)) as scraper,
            open_gpus(parse_devices(devices), visible=visible) as gpus,
        ):
            check_plan_against(plan, gpus, where=str(plan_path), allow_simulated=allow_simulated)
            if dry_run:
                first_read = functools.partial(scraper, timeout_s=LONGEST_READ_S)
                check_server_for_dry_run(first_read, url, gpus, records)
            note(
                f"governing {gpu_names(gpus)} from {plan_path} ({len(plan.steps)} step(s), drafter "
                f"{plan.drafter}), reading {redact_url(url)} every {interval:g}s"
                + (", dry run: nothing will change" if dry_run else "")
            )
            # With no --gpu, the server's GPUs (where found) count in its energy per token
            server_gpus = None if devices else ServerGpus(url, gpus, note, governing=True)
            with _exporting(address, live):
                governing.append(True)
                changes = run_governor(
                    plan,
                    gpus,
                    scraper,
                    params,
                    Ticker(interval, max_intervals),
                    live=live,
                    note=note,
                    dry_run=dry_run,
                    state_dir=records,
                    server_gpus=server_gpus,
                )
    if dry_run:
        note(f"dry run stopped: {changes} change(s) would have been made, none was")
    else:
        note(f"stopped after {changes} change(s); GPU settings restored")


@click.command()
@click.option(
    "--url",
    help="An SGLang server (with --enable-metrics) whose generated tokens give energy per token "
    "[default: GPU metrics only].",
)
@gpu_option
@interval_option
@listen_option("127.0.0.1:9436")  # not the governor's: it runs beside one
@max_intervals_option("")
@click.option(
    "--once",
    is_flag=True,
    help="Read twice, one interval apart, print the metrics page and exit (serves nothing).",
)
@click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs records applied caps and the governor's locks (clock locks are read "
    "from there) [default: $DVFS_STATE_DIR if set, else /var/lib/dvfs as root; else "
    "$XDG_STATE_HOME/dvfs if it holds a record, else /var/lib/dvfs].",
)
@wait_for_driver_option("before failing")
@handle_errors
@has_no_twin
def monitor(
    url: str | None,
    devices: tuple[str, ...],
    interval: float,
    listen: str,
    max_intervals: int | None,
    once: bool,
    state_dir: Path | None,
    wait_for_driver_s: int,
) -> None:
    """Export live power, energy, SM clock, power limit and energy per token (read-only).

    Changes nothing and takes no GPU lock, so it runs beside a sweep, `dvfs cap apply` or
    `dvfs govern` (whose metrics port, 9435, is not its own, 9436). Clock locks shown are those
    dvfs recorded (a running governor's, else `dvfs cap apply`'s); NVML cannot read a lock
    back. A GPU that stops answering is logged once (and once when it answers again) and
    exported with dvfs_gpu_up 0 and no readings; one still silent at the end makes it exit 1.
    A GPU that does not open (fallen off the bus, with --gpu or not) is named, exit 1, and the
    others exported; with no --gpu, so is one NVML counts but may not talk to (a warning line,
    exit 0: not exported). With no --gpu, energy per token counts the GPUs where NVML lists the
    processes of the server listening at --url (said in one line; every GPU, with one warning,
    where they cannot be found).
    """
    from dvfs.backends import lost_gpus, open_gpus, parse_devices, reachable_gpus, withheld_gpus
    from dvfs.caps.actuation import LockInForce, locks_in_force
    from dvfs.errors import CapsError, DvfsError
    from dvfs.govern.exporter import LiveMetrics, render
    from dvfs.govern.loop import Ticker
    from dvfs.govern.loop import monitor as run_monitor
    from dvfs.govern.metrics import ServerReader
    from dvfs.govern.servergpus import ServerGpus
    from dvfs.gpu.safety import records_dir

    if interval <= 0:
        raise click.BadParameter("must be more than 0", param_hint="--interval")
    address = None if once else _listen_address(listen)
    if url is not None:
        _check_url(url)
    directory = state_dir or records_dir()
    wait_for_the_driver(wait_for_driver_s, nothing="no GPU monitored")

    def locks() -> dict[str, LockInForce]:
        try:
            return locks_in_force(directory)
        except CapsError as exc:
            # dvfs's own record damaged: a failure, exit 1, which the unit restarts on (until
            # it is removed, or a governor starting on its GPU replaces it), not a bad option
            # (exit 2, on which it is left failed, as the README says)
            raise DvfsError(str(exc)) from exc

    # Every GPU or those named: one fallen off the bus must not stop the others' metrics; one
    # that opens but reads nothing (needing a reset) is exported as not up instead.
    named, lost = reachable_gpus(read=False, devices=parse_devices(devices))
    if not named and lost:
        raise lost_gpus(lost)
    if lost and not once:  # --once names them once, after its page
        note(f"warning: {lost_gpus(lost)}; exporting the other GPUs' metrics")
    # a GPU whose call hung (among `lost`) not asked again: a deadline more
    withheld = [] if devices else withheld_gpus(lost=lost)
    if withheld:  # every GPU leaves them out: said, not a quietly shorter page
        gpus_named = ", ".join(f"GPU {i}" for i in withheld)
        note(
            f"warning: the driver does not let this process talk to {gpus_named} (NVML: no "
            "permission): not exported, and in no energy per token; run dvfs monitor as a "
            "user the GPUs admit (root, with sudo) to export it"
        )
    # a lost GPU named by UUID is exported under that UUID
    unopened = (e.index if e.uuid is None else e.uuid for e in lost)
    live = LiveMetrics(unopened=tuple(g for g in unopened if g is not None))
    with ExitStack() as stack:
        scraper = (
            None if url is None else stack.enter_context(ServerReader(url, _timeout(interval)))
        )
        gpus = stack.enter_context(open_gpus(named, allow_mig=True))
        # With no --gpu, the server's GPUs (where it is local and they can be found) are those
        # that count in its energy per token: the node's other GPUs may serve other servers.
        server_gpus = None if url is None or devices else ServerGpus(url, gpus, note)
        if once:
            silent = run_monitor(
                gpus,
                scraper,
                Ticker(interval, 2),
                live=live,
                note=note,
                locks=locks,
                server_gpus=server_gpus,
            )
            click.echo(render(live), nl=False)
        else:
            with _exporting(address, live):
                silent = run_monitor(
                    gpus,
                    scraper,
                    Ticker(interval, max_intervals),
                    live=live,
                    note=note,
                    locks=locks,
                    server_gpus=server_gpus,
                )
    if lost or silent:  # the others' metrics printed or served: the run was not whole
        raise lost_gpus([*lost, *silent])
