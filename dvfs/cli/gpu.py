"""`dvfs gpu`: list and inspect GPUs (read-only), restore settings after a crash, measure a
roofline and how long a knob change takes to settle."""

from __future__ import annotations

import contextlib
import math
import shlex
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dvfs.cli.common import (
    OutputFile,
    OutputFolder,
    console,
    echo_json,
    escape,
    handle_errors,
    has_no_twin,
    make_parent,
    on_terminal,
    one_line,
    restore_status,
    show_beside_lost,
)
from dvfs.errors import GpuError, GpuPermissionError

if TYPE_CHECKING:
    from dvfs.backends import WithheldGpus
    from dvfs.gpu.base import Gpu


@contextlib.contextmanager
def open_cli_gpus(
    devices: tuple[str, ...],
    twin: str | None,
    *,
    allow_mig: bool = False,
    naming: str | None = None,
    lost: list[GpuError] | None = None,
) -> Iterator[list[Any]]:
    """GPUs named on the command line (all when none are named), from `dvfs.backends`; a UUID
    given to the twin is a usage error. `naming` (how the command names GPUs, as
    `dvfs.gpu.visible.SWEEP_NAMING`) for a command that changes or meters them: real GPUs are
    then held to CUDA_VISIBLE_DEVICES (`dvfs.backends.job_gpus`). With `lost`, a real GPU that
    does not open is added to it and left out (`dvfs.gpu.nvml.open_nvml_gpus`)."""
    from dvfs.backends import job_gpus, open_gpus, parse_devices

    parsed = parse_devices(devices)
    named = [str(d) for d in parsed if not isinstance(d, int)]
    if twin and named:
        raise click.UsageError(
            f"the twin's GPUs are named by index (0, 1, ...), not by UUID: {named[0]}"
        )
    visible = job_gpus(naming) if naming is not None and not twin else None
    with open_gpus(parsed, twin=twin, allow_mig=allow_mig, visible=visible, lost=lost) as gpus:
        yield gpus


twin_option = click.option(
    "--twin",
    metavar="PROFILE",
    help="Show the digital twin's GPUs (h100-sxm, h200-sxm) instead of NVML: one at every "
    "index, GPU 0 unless named.",
)

#: What `gpu list --twin` says under its one row: the twin has a GPU at every index.
TWIN_LIST_NOTE = (
    "the twin has a GPU at every index (0, 1, ...), each its own UUID; this lists GPU 0: name "
    "others by index, as in `dvfs gpu info 0 1 --twin {profile}` or `dvfs sweep CAMPAIGN "
    "--gpus 0-3`"
)


@click.group()
def gpu() -> None:
    """List and inspect GPUs; restore settings a crashed run left behind; measure a roofline
    and the settle time of a knob change."""


@gpu.command("list")
@twin_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON: a list of one object per GPU.")
@handle_errors
def list_gpus(twin: str | None, as_json: bool) -> None:
    """GPUs on this machine: index, UUID, name, driver, ECC mode, VBIOS, power limit, SM clock,
    MIG.

    A GPU fallen off the bus is named, exit 1, after the others are listed."""
    from dvfs.backends import lost_gpus
    from dvfs.gpu.describe import gpu_summary

    rows: list[dict[str, Any]] = []
    lost: list[GpuError] = []
    if twin:
        with open_cli_gpus((), twin, allow_mig=True) as gpus:
            rows = [gpu_summary(g) for g in gpus]
    else:
        rows, lost = _listed_rows()
    note = TWIN_LIST_NOTE.format(profile=twin) if twin else None
    if as_json:
        echo_json(rows)
        if note:
            console(stderr=True).print(note, highlight=False, soft_wrap=True)
        if lost:
            raise lost_gpus(lost)
        return
    from rich.table import Table

    cells: dict[str, Callable[[dict[str, Any]], str]] = {
        "driver": lambda r: r["driver"],
        "ECC": lambda r: r["ecc_mode"] or "-",  # "-": not read (the twin; NVML could not say)
        "VBIOS": lambda r: r["vbios_version"] or "-",
        "MIG": lambda r: "on (refused)" if r["mig"] else "off",
    }
    # What every GPU listed has alike (one driver per machine; most often one VBIOS, ECC mode
    # and MIG mode too) is said once under the table, not in a column of its own: the nine
    # columns made a table ~144 characters wide, wider than most terminals.
    shown = [r for r in rows if "error" not in r]
    alike = {
        col: values.pop()
        for col, cell in cells.items()
        if len(values := {cell(r) for r in shown}) == 1
    }
    columns = ("GPU", "uuid", "name", *(c for c in cells if c not in alike))  # GPU: its index
    table = Table()
    for col in (*columns, "power limit", "SM clock"):  # only a name (or an error) wraps
        table.add_column(col, no_wrap=col != "name", overflow="fold")
    for r in rows:
        if "error" in r:
            table.add_row(
                str(r["index"]), "", f"[red]{r['error']}[/red]", *[""] * (len(columns) - 1)
            )
            continue
        table.add_row(
            str(r["index"]),
            r["uuid"],
            r["name"],
            *(cells[c](r) for c in columns[3:]),
            "not supported" if r["power_limit_w"] is None else f"{r['power_limit_w']:g} W",
            f"{r['sm_clock_mhz']} MHz",
        )
    out = console()
    if not on_terminal(out):  # (a terminal's own width): the uuid whole, a long name or an
        out.width = 100  # error (or columns GPUs differ in) folded where it would not fit
    out.print(table)
    if alike:
        said = ", ".join(
            f"{col} {'not read' if value == '-' else value}" for col, value in alike.items()
        )
        every = "every GPU listed" if len(shown) > 1 else f"GPU {shown[0]['index']}"
        out.print(escape(f"{every}: {said}"))
    if note:
        console(stderr=True).print(note, highlight=False, soft_wrap=True)
    if lost:
        raise lost_gpus(lost)


def _listed_rows() -> tuple[list[dict[str, Any]], list[GpuError]]:
    """`gpu list`'s row of every GPU NVML lets this process talk to, in their order, and the
    errors of those that do not open or read (a row naming the error each). Each GPU on its
    own (a GPU fallen off the bus, or failing NVML otherwise, needing a reset, must not hide
    the others, nor which it is) and side by side (`side_by_side`, each GPU's calls on its own
    NVML worker): one after another, GPUs whose driver hangs cost a deadline each before the
    list was shown. A permission refusal of them all is no one GPU's (exit 4)."""
    from dvfs.gpu.describe import gpu_summary
    from dvfs.gpu.knobs import side_by_side
    from dvfs.gpu.nvml import every_gpu, log_held, nvml_session, open_device, warnings_held

    def read(index: int) -> tuple[dict[str, Any] | GpuError, list[str]]:
        if index in hung:  # its handle hung as every GPU was listed: not asked again
            return hung[index], []
        with warnings_held() as held:  # logged in the GPUs' order, whichever answers first
            try:
                return gpu_summary(open_device(module, index, allow_mig=True)), held
            except GpuError as exc:
                return exc, held

    hung: dict[int, GpuError] = {}
    with nvml_session() as module:
        indices = every_gpu(module, hung=hung)  # those NVML lets this process talk to
        read_all = side_by_side(indices, read, named=lambda index: f"list-gpu{index}")
        outcomes: dict[int, tuple[dict[str, Any] | GpuError, list[str]]] = {}
        with contextlib.closing(read_all) as finishing:
            for index, outcome in finishing:
                outcomes[index] = outcome
    rows: list[dict[str, Any]] = []
    lost: list[GpuError] = []
    for index in indices:
        row, warned = outcomes[index]
        log_held(warned)
        if isinstance(row, GpuPermissionError):
            raise row
        if isinstance(row, GpuError):
            row.index = index
            lost.append(row)
            rows.append({"index": index, "error": str(row)})
            continue
        rows.append(row)
    return rows, lost


@gpu.command("info")
@click.argument("devices", nargs=-1)
@twin_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON: a list of one object per GPU.")
@handle_errors
def info(devices: tuple[str, ...], twin: str | None, as_json: bool) -> None:
    """Supported clocks, power-limit range, current and enforced settings, persistence,
    energy-counter support and clock-event reasons of DEVICES (indices or UUIDs; all if none).
    A GPU fallen off the bus (named or not) is named, exit 1, after the others are shown."""
    from dvfs.backends import parse_devices, reachable_gpus
    from dvfs.gpu.describe import gpu_details

    lost: list[Any] = []
    if not twin:  # every GPU or those named: one fallen off the bus must not hide the others
        openable, lost = reachable_gpus(devices=parse_devices(devices), shown=True)
        if not openable and lost:
            show_beside_lost([], lost, as_json=as_json, show=_print_details)
        devices = tuple(str(i) for i in openable)
    with open_cli_gpus(devices, twin, allow_mig=True) as gpus:
        infos = [gpu_details(g) for g in gpus]
    show_beside_lost(infos, lost, as_json=as_json, show=_print_details)


def _print_details(infos: Sequence[dict[str, Any]]) -> None:
    """`gpu info`'s lines per GPU, from `gpu_details`."""
    out = console()
    for i in infos:
        c, p = i["supported_sm_clocks_mhz"], i["power_limit_w"]
        said = [
            f"{what} {i[key]}"
            for key, what in (("ecc_mode", "ECC"), ("vbios_version", "VBIOS"))
            if i.get(key)
        ]
        driver = f"{i['driver']} ({', '.join(said)})" if said else i["driver"]
        out.print(f"[bold]GPU {i['index']}[/bold] {i['name']} ({i['uuid']}), driver {driver}")
        out.print(
            f"  SM clocks: {c['count']} supported, {c['min']}-{c['max']} MHz; "
            f"now {i['sm_clock_mhz']} MHz;"
            f" memory clock {i['memory_clock_mhz']} MHz"
        )
        if p["current"] is None:
            out.print(
                f"  power limit: not supported by NVML, not settable (enforced {p['enforced']:g} W)"
            )
        else:
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
        temperature = "-" if i["temperature_c"] is None else f"{i['temperature_c']} C"
        reasons = (  # None: NVML cannot read them, which is not "none set"
            "unknown (NVML cannot read them)"
            if i["event_reasons"] is None
            else ", ".join(i["event_reasons"]) or "none"
        )
        out.print(f"  now: {power}, {temperature}, event reasons: {reasons}")


@gpu.command("reset")
@click.argument("devices", nargs=-1)
@click.option(
    "--defaults",
    is_flag=True,
    help="With no state file (or one from before the last reboot, which is dropped), reset to "
    "driver defaults (unlock clocks, default power limit).",
)
@click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs keeps state files [default: $DVFS_STATE_DIR if set, else /var/lib/dvfs "
    "as root, else $XDG_STATE_HOME/dvfs].",
)
@handle_errors
@has_no_twin
def reset(devices: tuple[str, ...], defaults: bool, state_dir: Path | None) -> None:
    """Restore GPU settings recorded by a dvfs run that died (SIGKILL, power loss).

    Without DEVICES, every GPU with a state file, but those a running dvfs is using (it
    restores them itself), with a note. A GPU fallen off the bus (named or not) is named, exit
    1, once the others are restored (its state file stays for when it answers again); so is a
    GPU whose state file is unreadable (damaged), left as it is for the file to be inspected.
    Without DEVICES, a state file none of them has, where NVML counts a GPU it has no
    permission to talk to (every GPU leaves it out), is named, exit 4, once the others are
    restored: it may be that GPU's; with --defaults, so are caps dvfs recorded for none of
    them (as `dvfs cap reset` names them).
    Holds each GPU's lock while restoring, so it refuses a GPU named in DEVICES that a running
    dvfs is using.
    """
    from dvfs.backends import WithheldGpus, lost_gpus, parse_devices, reachable_gpus
    from dvfs.caps import reset_gpus
    from dvfs.errors import GpuBusyError, GpuError
    from dvfs.gpu.knobs import RestoreBugError
    from dvfs.gpu.safety import default_state_dir, state_dir_flag

    out = console()
    every = not devices
    # the reset to run again (a lock in the state folder that cannot be written), as typed:
    # its DEVICES dropped, --defaults would reset every GPU
    named = devices
    command = shlex.join(["dvfs", "gpu", "reset", *named, *(["--defaults"] if defaults else [])])
    # Every GPU or those named: one fallen off the bus must not keep the others unrestored.
    # A power limit NVML does not support fails none: a restore and --defaults put back the
    # clocks of such a GPU and leave its power limit be (dvfs never changed it).
    openable, lost = reachable_gpus(devices=parse_devices(devices), unsupported_ok=True)
    devices = tuple(str(i) for i in openable)
    if not devices and lost:
        raise lost_gpus(lost)
    directory = state_dir or default_state_dir()
    # (opened side by side; one that began hanging or fell off the bus since it was probed is
    # named with those lost, the others restored)
    with open_cli_gpus(devices, None, allow_mig=True, lost=lost) as gpus:
        # every GPU leaves out one NVML may not talk to: a state file none of those opened
        # has may be its, left unrestored, which must not read as "nothing to restore"
        # the GPUs NVML withholds, asked once for both lines, a hung GPU not asked again
        asked = WithheldGpus(lost)
        withheld = _withheld_state(directory, gpus, lost, asked) if every else ""
        if every and defaults:  # --defaults resets every GPU's caps too, as `cap reset` does
            from dvfs.backends import withheld_caps_line

            caps = withheld_caps_line(
                directory,
                gpus,
                "those caps were not reset",
                f"dvfs gpu reset --defaults{state_dir_flag(directory)}",
                lost,
                asked,
            )
            withheld = "; ".join(p for p in (withheld, caps) if p)
        try:
            acted = reset_gpus(
                gpus,
                directory,
                defaults=defaults,
                note=lambda line: out.print(escape(line)),
                skip_busy=every,  # every GPU: one a live dvfs holds is its own to restore
                command=command,
                caps_command=shlex.join(["dvfs", "cap", "reset", *named]),
            )
        except GpuError as exc:
            if not (lost or withheld) or isinstance(exc, GpuBusyError):
                raise  # a GPU named that another dvfs holds: refused before any change
            # A GPU that failed to restore (or whose state file is unreadable, left as it is)
            # must not hide one fallen off the bus, nor the state files (caps) of GPUs NVML
            # may not talk to: all named (exit 4 with the latter, as without the failure).
            told = "; ".join(p for p in (str(exc), withheld, lost and str(lost_gpus(lost))) if p)
            raise (GpuPermissionError if withheld else type(exc))(told) from None
        except RestoreBugError as exc:  # an internal error: nor must a bug hide them
            if not (lost or withheld):
                raise
            told = "; ".join(p for p in (str(exc), withheld, lost and str(lost_gpus(lost))) if p)
            raise RestoreBugError(told) from exc.__cause__
    if not acted:
        # A GPU that does not open may hold a state file (a governor it left): not "none".
        which = "the GPUs that open" if lost or withheld else "these GPUs"
        out.print(
            f"No dvfs state files for {which}: nothing to restore "
            "(use --defaults to reset to driver defaults anyway)."
        )
    if withheld:
        raise GpuPermissionError(
            "; ".join(p for p in (withheld, lost and str(lost_gpus(lost))) if p)
        )
    if lost:
        raise lost_gpus(lost)


def _withheld_state(
    directory: Path, gpus: Sequence[Gpu], lost: Sequence[GpuError], asked: WithheldGpus
) -> str:
    """The line naming the state files in `directory` that none of `gpus` (every GPU) has,
    where NVML counts GPUs it has no permission to talk to (every GPU leaves them out, their
    UUIDs unreadable: such a file may be one's); "" where there is none. The file of a GPU of
    `lost` whose UUID NVML reads is left to the line naming it (`withheld_records_line`).
    `asked`: the GPUs NVML withholds, asked once for the command."""
    from dvfs.backends import withheld_records_line
    from dvfs.gpu.safety import state_dir_flag

    opened = {g.identity.uuid for g in gpus}
    files = [] if not directory.is_dir() else sorted(directory.glob("GPU-*.json"))
    others = [f.stem for f in files if f.stem not in opened]
    return withheld_records_line(
        others,
        f"state files in {directory} record",
        "their settings were not restored",
        f"dvfs gpu reset{state_dir_flag(directory)}",  # run with sudo, which drops the env
        lost,
        asked,
    )


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...]:
    """`1980,1500,1200` as integers; one clear line for anything else (an empty list or entry
    too, as --gpus refuses them: `--clocks ''` measured the default clocks, `1500,,1200` two
    settings, without a word). A value listed twice is
    refused, as a campaign's sm_clock and power_limit lists refuse it: dropping the repeat
    silently measured fewer settings than the user listed, without a word."""
    if value is None:  # left out: the command's default
        return ()
    if not value.strip():  # `--clocks ""` (an unset shell variable): as --gpus refuses it
        raise click.BadParameter("it is empty: give e.g. 1980,1500,1200, or leave it out")
    entries = [v.strip() for v in value.split(",")]
    if not all(entries):  # `1500,,1200` or `1500,`: as --gpus refuses an empty entry
        raise click.BadParameter(f"{value!r}: an empty entry; write e.g. 1980,1500,1200")
    try:
        numbers = tuple(int(v) for v in entries)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if any(n <= 0 for n in numbers):
        raise click.BadParameter(f"{value!r}: every value must be positive")
    twice = next((n for i, n in enumerate(numbers) if n in numbers[:i]), None)
    if twice is not None:
        raise click.BadParameter(f"{value!r} lists {twice} twice: give each value once")
    return numbers


#: Default sizes per device: a GPU gets the model's real widths and GiB-sized arrays; the CPU
#: path (CI, laptops) the same kernels scaled down so it finishes in seconds.
CUDA_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CPU_TOKENS = (1, 4, 16, 64, 256)
CPU_SCALE = 8


@gpu.command("roofline")
@click.option(
    "--device",
    default="cuda",
    show_default=True,
    help="torch device that runs the kernels: cuda, cuda:N, or cpu (tiny sizes, no energy).",
)
@click.option(
    "--gpu",
    "gpu_index",
    metavar="INDEX|UUID",
    help="NVML GPU whose clocks are stepped and whose energy counter is read [default: the "
    "CUDA device's own GPU; none with --device cpu].",
)
@click.option(
    "--clocks", callback=_int_list, help="SM clocks to lock after stock, e.g. 1980,1500,1200."
)
@click.option(
    "--observe-only",
    is_flag=True,
    help="Stock setting only; never change a GPU setting (no root needed).",
)
@click.option(
    "--model",
    default="llama-3.1-8b",
    show_default=True,
    help="Twin model profile whose hidden and MLP widths shape the GEMMs.",
)
@click.option("--hidden", type=click.IntRange(min=1), help="Override the model's hidden size.")
@click.option("--intermediate", type=click.IntRange(min=1), help="Override the MLP width.")
@click.option("--tokens", callback=_int_list, help="GEMM token counts M [default: 1 to 8192].")
@click.option(
    "--bandwidth-mib",
    type=click.FloatRange(min=0.001),
    help="Size of each triad/copy array [default: 1024 on a GPU, 64 on the CPU].",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    help="[default: bfloat16 on a GPU, float32 on the CPU]",
)
@click.option(
    "--min-time",
    type=click.FloatRange(min=0.0),
    default=0.1,
    show_default=True,
    help="Seconds each kernel is timed for.",
)
@click.option(
    "--energy-window",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds of energy counter per kernel (many counter updates).",
)
@click.option(
    "--settle",
    type=click.FloatRange(min=0.0),
    default=0.5,
    show_default=True,
    help="Seconds to wait after changing the clock.",
)
@click.option(
    "-o",
    "--out",
    "out_path",
    type=OutputFile("roofline.nc"),
    help="Write the netCDF roofline file (input of `dvfs twin fit`, `dvfs compare --roofline`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.roofline/1).")
@click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs keeps state files (as for `dvfs gpu reset`).",
)
@click.option(
    "--twin",
    metavar="PROFILE",
    help="Simulate the roofline on the digital twin's GPU (h100-sxm, h200-sxm): no torch.",
)
@handle_errors
def roofline(
    device: str,
    gpu_index: str | None,
    clocks: tuple[int, ...],
    observe_only: bool,
    model: str,
    hidden: int | None,
    intermediate: int | None,
    tokens: tuple[int, ...],
    bandwidth_mib: float | None,
    dtype: str | None,
    min_time: float,
    energy_window: float,
    settle: float,
    out_path: Path | None,
    as_json: bool,
    state_dir: Path | None,
    twin: str | None,
) -> None:
    """Measure this GPU's roofline with torch: GEMMs over token counts M at the model's widths,
    a bandwidth triad and copy, the decode GEMV; at stock and at each of --clocks (locked and
    restored like a sweep). Prints peak FLOP/s, bandwidth, the ridge point, power and J per
    FLOP and per byte per clock, and GEMM efficiency by M."""
    from dvfs.errors import GpuPermissionError
    from dvfs.gpu.base import unsupported_clock
    from dvfs.roofline import store
    from dvfs.roofline.kernels import BenchSpec, element_bytes, import_torch
    from dvfs.roofline.run import RooflineRequest, run_roofline
    from dvfs.twin.profiles import model_profile

    if twin is None:
        import_torch()  # without it, the one line that says how to install it, and nothing else
    else:
        ctx = click.get_current_context()
        given = [
            name
            for name, param in (("--device", "device"), ("--gpu", "gpu_index"))
            if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise click.UsageError(
                f"--twin simulates the twin's GPU at the model's own sizes, so "
                f"{' and '.join(given)} (the hardware to measure) does not apply: drop it"
            )
    on_cpu = device == "cpu"
    if not (on_cpu or device == "cuda" or device.startswith("cuda:")):
        raise click.BadParameter(f"{device!r}: use cuda, cuda:N or cpu", param_hint="--device")
    shape = model_profile(model)
    scale = CPU_SCALE if on_cpu else 1
    dtype = dtype or ("float32" if on_cpu else "bfloat16")
    mib = bandwidth_mib if bandwidth_mib is not None else (64.0 if on_cpu else 1024.0)
    spec = BenchSpec(
        device=device,
        dtype=dtype,
        hidden=hidden or max(1, shape.hidden // scale),
        intermediate=intermediate or max(1, shape.intermediate // scale),
        tokens=tokens or (CPU_TOKENS if on_cpu else CUDA_TOKENS),
        bandwidth_elements=max(1, int(mib * 2**20) // element_bytes(dtype)),
        min_time_s=min_time,
    )
    err = console(stderr=True)
    if twin is not None:
        from dvfs.roofline.twin import simulate
        from dvfs.twin.profiles import gpu_profile

        profile = gpu_profile(twin)
        for mhz in clocks:
            problem = unsupported_clock(mhz, profile.supported_sm_clocks_mhz(), of=" of the twin")
            if problem:
                raise click.BadParameter(problem, param_hint="--clocks")
        if observe_only and clocks:
            raise click.UsageError("--observe-only runs at the stock setting only: drop --clocks")
        result = simulate(profile, spec, clocks)
    else:
        target: int | str | None = None
        if gpu_index is not None:
            target = int(gpu_index) if gpu_index.isdigit() else gpu_index
        elif not on_cpu:
            target = _cuda_gpu(spec)
        from dvfs.backends import job_gpus

        request = RooflineRequest(
            spec,
            clocks,
            target,
            observe_only,
            energy_window,
            settle,
            state_dir,
            visible=job_gpus("--gpu {indices}") if target is not None else None,
        )
        total_s = request.estimated_s()
        length = f"{total_s:.0f} s" if total_s < 120 else f"{total_s / 60:.0f} min"
        err.print(f"about {length} of measurement")
        try:
            # a GPU's settings said where the run could change them (not observe-only)
            changes = target is not None and not observe_only
            with _interruption_told(err, request.unrestored if changes else None):
                result = run_roofline(request, note=lambda line: err.print(escape(line)))
        except GpuPermissionError as exc:
            raise GpuPermissionError(
                f"{exc}. `dvfs gpu roofline --observe-only` measures at the stock setting "
                "without root"
            ) from exc
    ds = store.build_dataset(result)
    ds.attrs["model"] = shape.key
    if out_path is not None:
        make_parent(out_path)  # as `dvfs report -o` makes it
        store.write(ds, out_path)
    doc = store.document(ds)
    if as_json:
        echo_json(doc)
    else:
        _render_roofline(doc)
    if out_path is not None:
        err.print(f"wrote {escape(str(out_path))}")


def _cuda_gpu(spec: Any) -> int | str | None:
    """The NVML UUID of the CUDA device, so knobs and energy follow the GPU that computes."""
    from dvfs.roofline.kernels import check_device, cuda_uuid, import_torch

    torch = import_torch()
    check_device(spec, torch)
    return cuda_uuid(spec, torch) or (int(spec.device.partition(":")[2] or 0))


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _render_roofline(doc: dict[str, Any]) -> None:
    from dvfs.cli.analysis import print_table
    from dvfs.roofline.store import efficiency_rows, summary_rows

    out = console()
    out.print(
        f"[bold]Roofline[/bold] of {escape(str(doc.get('gpu_name') or doc['device_name']))} "
        f"(kernels on {escape(doc['device'])}, {doc['dtype']}, hidden {doc['hidden']}, "
        f"intermediate {doc['intermediate']})"
    )
    print_table("Per setting", *summary_rows(doc))
    print_table("GEMM efficiency by token count M (first setting)", *efficiency_rows(doc))
    idle = [
        f"{doc[power]:.1f} W at {doc[clock]:.0f} MHz"
        + (f", {doc[hot]:.0f} degC" if _finite(doc.get(hot)) else "")
        + f" {when}"
        for power, clock, hot, when in (
            ("idle_power_w", "idle_sm_clock_mhz", "idle_temperature_c", "before the kernels"),
            (
                "raised_idle_power_w",
                "raised_idle_sm_clock_mhz",
                "raised_idle_temperature_c",
                "right after the stock ones",
            ),
        )
        if _finite(doc.get(power)) and _finite(doc.get(clock))
    ]
    if idle:
        out.print("Idle: " + "; ".join(idle))
    for line in doc["notes"]:
        out.print(f"[yellow]note:[/yellow] {escape(line)}")


@gpu.command("settle")
@click.option(
    "--gpu",
    "devices",
    metavar="INDEX|UUID",
    multiple=True,
    help="GPU to measure (repeat for several, measured together) [default: 0].",
)
@click.option(
    "--clocks",
    callback=_int_list,
    help="SM clocks to lock in turn, from stock and back, e.g. 1980,1200 [default: the "
    "highest supported clock and the one nearest half of it; none with --power-limits].",
)
@click.option(
    "--power-limits",
    callback=_int_list,
    help="Power limits (W) to set in turn, from stock and back, e.g. 700,300 (needs --load).",
)
@click.option(
    "--load",
    "with_load",
    is_flag=True,
    help="Keep the GPU busy with large GEMMs while timing (torch on the GPU's own CUDA device; "
    "simulated on the twin), so power is timed too [default: idle, the clock only].",
)
@click.option(
    "--load-device",
    default="cuda",
    show_default=True,
    help="torch device of --load: cuda (each GPU's own) or cpu (small GEMMs: tests the path).",
)
@click.option(
    "--observe-only",
    is_flag=True,
    help="Refused: a settle time is measured by changing a knob.",
)
@click.option(
    "--sample-period",
    type=click.FloatRange(min=0.001),
    default=0.005,
    show_default=True,
    help="Seconds between readings of the clock (and power).",
)
@click.option(
    "--hold",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    help="Seconds a reading must stay within tolerance to count as settled.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Longest wait for one change to settle.",
)
@click.option(
    "--margin",
    type=click.FloatRange(min=0.0),
    default=0.5,
    show_default=True,
    help="Safety margin on the settle to use (0.5: half as long again as measured).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.settle/1).")
@click.option(
    "--state-dir",
    type=OutputFolder(),
    help="Where dvfs keeps state files (as for `dvfs gpu reset`).",
)
@click.option(
    "--twin",
    metavar="PROFILE",
    help="Measure the digital twin's GPU (h100-sxm, h200-sxm) in virtual time instead of NVML.",
)
@handle_errors
def settle(
    devices: tuple[str, ...],
    clocks: tuple[int, ...],
    power_limits: tuple[int, ...],
    with_load: bool,
    load_device: str,
    observe_only: bool,
    sample_period: float,
    hold: float,
    timeout: float,
    margin: float,
    as_json: bool,
    state_dir: Path | None,
    twin: str | None,
) -> None:
    """Measure how long a clock lock or power-limit change takes to show in the observed SM
    clock (and, under a load, the power) on this GPU, and the settle a sweep should wait.

    Steps through stock, each of --clocks and back to stock, then each of --power-limits and
    back, timing every change. Changes GPU settings (root needed) under the sweep's safety
    layer: the GPU's lock, a state file, and a restore on exit and on SIGINT/SIGTERM/SIGHUP."""
    from dvfs.errors import GpuPermissionError

    if observe_only:
        raise click.UsageError(
            "--observe-only cannot measure a settle time: it is measured by changing a knob "
            "(run as root without --observe-only)"
        )
    if power_limits and not with_load:
        raise click.UsageError(
            "a power limit shows in the clock and power only under a load: add --load"
        )
    if load_device not in ("cuda", "cpu"):
        raise click.BadParameter(f"{load_device!r}: use cuda or cpu", param_hint="--load-device")
    if hold >= timeout:
        raise click.BadParameter(
            f"--hold ({hold:g} s) must be shorter than --timeout ({timeout:g} s)",
            param_hint="--hold",
        )
    err = console(stderr=True)
    with open_cli_gpus(devices or ("0",), twin, naming="--gpu with {listed}") as gpus:
        plan = _settle_plan(gpus, clocks, power_limits, twin)
        load = _settle_load(gpus, twin, load_device) if with_load else None
        try:
            with _interruption_told(err, None if twin else lambda: _unrestored(state_dir)):
                results = _run_settle(
                    gpus, plan, twin, state_dir, load, sample_period, hold, timeout, margin
                )
        except GpuPermissionError as exc:
            raise GpuPermissionError(
                f"{exc}. `dvfs gpu settle` changes a knob to time it, so it needs root"
            ) from exc
        doc = _settle_document(gpus, results, twin, margin)
    if as_json:
        echo_json(doc)
        return
    _render_settle(doc)


def _settle_plan(
    gpus: list[Any], clocks: tuple[int, ...], power_limits: tuple[int, ...], twin: str | None
) -> list[Any]:
    """The settings to step through, each checked against every GPU before anything changes:
    stock, the clocks, stock, the power limits, stock."""
    from dvfs.gpu.base import unsupported_clock
    from dvfs.gpu.knobs import KnobSetting

    if not clocks and not power_limits:
        supported = sorted(gpus[0].supported_sm_clocks_mhz())
        top = supported[-1]
        half = min(supported, key=lambda c: abs(c - top / 2))
        clocks = (top, half)
    of = " of the twin" if twin else ""
    for gpu in gpus:
        supported = gpu.supported_sm_clocks_mhz()
        for mhz in clocks:
            problem = unsupported_clock(mhz, supported, of=of or f" of GPU {gpu.identity.index}")
            if problem:
                raise click.BadParameter(problem, param_hint="--clocks")
        for watts in power_limits:
            problem = gpu.power_limit_range().outside(watts * 1000)
            if problem:
                raise click.BadParameter(problem, param_hint="--power-limits")
    stock = KnobSetting(None, None)
    plan = [stock]
    if clocks:
        plan += [KnobSetting(c, None) for c in clocks] + [stock]
    if power_limits:
        plan += [KnobSetting(None, float(w)) for w in power_limits] + [stock]
    return plan


@contextlib.contextmanager
def _settle_guard(gpus: list[Any], twin: str | None, state_dir: Path | None) -> Iterator[Any]:
    """A `KnobController` over the GPUs: on real ones under their locks, with a state file
    and a refusal of unrestored state, as a sweep has; the twin's restore needs neither."""
    from dvfs.gpu.knobs import KnobController

    if twin:
        with KnobController(gpus) as knobs:
            yield knobs
        return
    from dvfs.caps import AppliedCaps
    from dvfs.gpu.safety import GpuLocks, StateStore, default_state_dir

    directory = state_dir or default_state_dir()
    store = StateStore(directory, command="gpu settle")
    with GpuLocks(directory).hold(gpus):
        store.refuse_if_pending(gpus)
        controller = AppliedCaps(directory).measuring(gpus, change_log=store)
        with controller as knobs:
            yield knobs


def _unrestored(state_dir: Path | None) -> tuple[list[str], Path]:
    """GPUs this process changed and did not restore (their state files), and where."""
    from dvfs.gpu.safety import StateStore, default_state_dir

    store = StateStore(state_dir or default_state_dir())
    return store.left_by_this_process(), store.directory


@contextlib.contextmanager
def _interruption_told(
    err: Any, unrestored: Callable[[], tuple[list[str], Path]] | None
) -> Iterator[None]:
    """A command that changes GPU settings, interrupted (Ctrl-C, SIGTERM, SIGHUP), ends as an
    interrupted sweep does: the GPUs' settings said (`unrestored`: those left changed and
    where their state files are; None on the twin, which has none), exit 130/143/129; also
    where the restore it unwound to failed (the restore's error then said too), which else hid
    the interruption behind an exit 1."""
    from dvfs.signals import Interrupted

    try:
        yield
    except (KeyboardInterrupt, Interrupted):
        if unrestored is not None:
            err.print(restore_status(*unrestored()), soft_wrap=True)
        raise
    except GpuError as exc:
        from dvfs.sweep import interruption_of

        interruption = interruption_of(exc)
        if interruption is None:
            raise
        if unrestored is not None:
            err.print(restore_status(*unrestored()), soft_wrap=True)
        click.echo(f"Error: {one_line(str(exc))}", err=True)
        raise interruption from None


def _settle_load(gpus: list[Any], twin: str | None, device: str) -> Any:
    """The --load: simulated GEMMs on the twin, torch GEMMs on real GPUs (prepared before any
    knob changes, so a missing torch or CUDA device changes nothing)."""
    from dvfs.measure.loads import torch_gemm_load, twin_gemm_load

    if twin:
        return twin_gemm_load(gpus)
    return torch_gemm_load(gpus, device)


def _run_settle(
    gpus: list[Any],
    plan: list[Any],
    twin: str | None,
    state_dir: Path | None,
    load: Any,
    sample_period: float,
    hold: float,
    timeout: float,
    margin: float,
) -> list[Any]:
    """Each change of the plan, timed (under `load` when given, else idle)."""
    from dvfs.clock import MonotonicClock
    from dvfs.measure.settle import measure_settle

    clock = gpus[0].device.clock if twin else MonotonicClock()
    results = []
    with _settle_guard(gpus, twin, state_dir) as knobs:
        for before, after in zip(plan, plan[1:], strict=False):
            if all(knobs.target(g, before) == knobs.target(g, after) for g in gpus):
                continue  # e.g. a power limit the GPU already holds: nothing to time
            results.append(
                measure_settle(
                    gpus,
                    knobs,
                    clock,
                    before=before,
                    after=after,
                    sample_period_s=sample_period,
                    timeout_s=timeout,
                    hold_s=hold,
                    load=load,
                    margin=margin,
                )
            )
    return results


def _settle_document(
    gpus: list[Any], results: list[Any], twin: str | None, margin: float
) -> dict[str, Any]:
    observed = [r for r in results if r.observed]
    return {
        "schema": "dvfs.settle/1",
        "gpus": [
            {"index": g.identity.index, "uuid": g.identity.uuid, "name": g.identity.name}
            for g in gpus
        ],
        "twin_profile": twin,
        "margin": margin,
        "changes": [r.as_dict() for r in results],
        # a change not observed counts as its timeout: the settle to use stays safe
        "settle_s": max((r.settle_s for r in results), default=None),
        "all_observed": len(observed) == len(results),
        "gpu_time_s": sum(r.gpu_time_s for r in results),
    }


def _render_settle(doc: dict[str, Any]) -> None:
    from dvfs.cli.analysis import print_table

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    def number(value: float | None, unit: str) -> str:
        return "-" if value is None else f"{value:.0f} {unit}"

    names = ", ".join(f"GPU {g['index']} {g['name']}" for g in doc["gpus"])
    rows = [
        [
            f"{c['before']} -> {c['after']}",
            f"{number(c['clock_before_mhz'], 'MHz')} -> {number(c['clock_after_mhz'], 'MHz')}",
            seconds(c["clock_s"]),
            seconds(c["power_s"]),
            seconds(c["settle_s"]),
            "yes" if c["observed"] else "no",
        ]
        for c in doc["changes"]
    ]
    header = ["change", "SM clock", "clock settle", "power settle", "settle to use", "observed"]
    print_table(f"Settle time of {names}", header, rows)
    out = console()
    if all(c["power_s"] is None for c in doc["changes"]):
        out.print("Measured idle: the clock only (--load times power too).")
    for c in doc["changes"]:
        if c["note"]:
            out.print(f"[yellow]note:[/yellow] {c['before']} -> {c['after']}: {escape(c['note'])}")
    if doc["settle_s"] is None:
        out.print("Nothing to time: every change left the GPU as it was.")
    elif not doc["all_observed"]:
        out.print(
            f"[yellow]Not every change settled within the timeout[/yellow]: settle for "
            f"{doc['settle_s']:g} s (the timeout), or measure again with a longer --timeout."
        )
    else:
        out.print(
            f"Settle to use: {doc['settle_s']:.3f} s (the longest change, +{doc['margin']:.0%} "
            f"and one sample); {doc['gpu_time_s']:.1f} s of GPU time."
        )
