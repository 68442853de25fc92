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


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...]:
    """`1980,1500,1200` as integers, each once; one clear line for anything else."""
    if not value:
        return ()
    try:
        numbers = tuple(dict.fromkeys(int(v) for v in value.split(",") if v.strip()))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if any(n <= 0 for n in numbers):
        raise click.BadParameter(f"{value!r}: every value must be positive")
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
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the netCDF roofline file (input of `dvfs twin fit`, `dvfs compare --roofline`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.roofline/1).")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
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
    from dvfs.signals import Interrupted
    from dvfs.twin.profiles import model_profile

    if twin is None:
        import_torch()  # without it, the one line that says how to install it, and nothing else
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
        request = RooflineRequest(
            spec, clocks, target, observe_only, energy_window, settle, state_dir
        )
        total_s = request.estimated_s()
        length = f"{total_s:.0f} s" if total_s < 120 else f"{total_s / 60:.0f} min"
        err.print(f"about {length} of measurement")
        try:
            result = run_roofline(request, note=lambda line: err.print(escape(line)))
        except GpuPermissionError as exc:
            raise GpuPermissionError(
                f"{exc}. `dvfs gpu roofline --observe-only` measures at the stock setting "
                "without root"
            ) from exc
        except (KeyboardInterrupt, Interrupted):
            if target is not None:
                left, where = request.unrestored()
                err.print(
                    f"[red]GPU settings NOT fully restored[/red] for {', '.join(left)}: run "
                    f"`dvfs gpu reset` (state in {where})."
                    if left
                    else "GPU settings restored."
                )
            raise
    ds = store.build_dataset(result)
    ds.attrs["model"] = shape.key
    if out_path is not None:
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
    for line in doc["notes"]:
        out.print(f"[yellow]note:[/yellow] {escape(line)}")
