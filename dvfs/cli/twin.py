"""`dvfs twin`: calibrate the digital twin from measurements, and predict a campaign with it.

`dvfs twin fit` takes a roofline file (`dvfs gpu roofline -o FILE`) or a sweep cube (a cube
file or a sweep folder); both write a profile TOML. `dvfs twin predict` sweeps a campaign on
the twin with such a profile, in virtual time, through the ordinary sweep pipeline.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dvfs.cli.common import (
    ExistingPath,
    OutputFile,
    OutputFolder,
    console,
    escape,
    fail,
    handle_errors,
    make_parent,
)

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.campaign.model import Campaign
    from dvfs.twin.profiles import GpuProfile

#: Cells the cube fit uses at most (a random subsample beyond, said in the notes): a demo cube
#: fits in seconds; every cell of a large cube would cost minutes and tell little more.
MAX_FIT_CELLS = 2000


@click.group()
def twin() -> None:
    """The digital twin: fit it to measurements, predict a campaign with it."""


@twin.command("fit")
@click.argument("source", type=ExistingPath(), metavar="ROOFLINE_OR_CUBE")
@click.option(
    "-o",
    "--out",
    "out_path",
    type=OutputFile("profile.toml"),
    required=True,
    help="Profile TOML to write.",
)
@click.option(
    "--base",
    help="Twin GPU profile whose other figures are kept and the fit starts from [default: a "
    "twin cube's own profile, else the one matching the measured GPU's name].",
)
@click.option("--name", help="Key of the fitted profile [default: <base>-fit].")
@click.option(
    "--max-cells",
    type=click.IntRange(min=10),
    default=MAX_FIT_CELLS,
    show_default=True,
    help="Cube fit: at most this many valid cells (a random subsample beyond).",
)
@handle_errors
def fit(source: Path, out_path: Path, base: str | None, name: str | None, max_cells: int) -> None:
    """Fit the twin's GPU to ROOFLINE_OR_CUBE and write a profile TOML with the fit's residuals.

    From a `dvfs gpu roofline` file: the compute and memory efficiencies (with GEMM efficiency
    by token count), the bandwidth knee and the power coefficients. From a sweep cube (file or
    sweep folder): the figures in `dvfs.twin.fitcube.CUBE_FIT_PARAMETERS` by least squares on
    each cell's energy per token, time per token and mean power, as the twin's own physics
    predicts them (fixed-batch cubes measured per level, not in-flight)."""
    from dvfs.cli.report import check_output
    from dvfs.twin.fit import fit_input_kind

    kind = fit_input_kind(source)
    if kind is None and source.is_dir():
        from dvfs.cube import CUBE_NAME, open_cube
        from dvfs.inputs import link_loop_problem
        from dvfs.measure.journal import JOURNAL_NAME

        cube = source / CUBE_NAME
        if cube.exists() or link_loop_problem(cube):
            # a cube.nc there that is no file (a FIFO, a device, a folder, a link in a loop):
            # refused as `dvfs cube info` refuses it, not "no cube.nc: build the cube", whose
            # build fails on it or writes into it
            open_cube(cube)
        if (source / JOURNAL_NAME).is_file() and _link_into_no_folder(cube):
            # `dvfs cube build` refuses to write through it: its advice alone was a dead end
            fail(
                f"{source} holds a sweep journal, and its cube.nc ({cube}) is a link to "
                f"{os.path.realpath(cube)}, in a folder that does not exist, which `dvfs cube "
                "build` cannot write through: make that folder (or remove the link), build the "
                f"cube with `dvfs cube build {shlex.quote(str(source))}`, then fit again",
                2,
            )
        journal = source / JOURNAL_NAME
        if os.path.lexists(journal) and not journal.exists():
            from dvfs.cube.build import no_journal

            # a link in a loop or to no file, where the cube is not: said as `dvfs cube build`
            # says it, not "neither a roofline file nor a cube" of a sweep folder
            raise no_journal(journal)
        if journal.is_file():  # a sweep stopped before it wrote its cube
            fail(
                f"{source} holds a sweep journal but no cube.nc: build the cube from it with "
                f"`dvfs cube build {shlex.quote(str(source))}`, then fit again",
                2,
            )
        if os.path.islink(cube) and not cube.exists():
            # a link to no file (its cube moved or removed) and no journal: named, not
            # "neither a roofline file nor a cube" of the folder
            fail(
                f"{source}'s cube.nc ({cube}) is a symbolic link to {os.readlink(cube)}, which "
                "does not exist: point it at the cube, or give the cube's own path",
                2,
            )
    if kind is None and source.exists() and not source.is_dir() and not source.is_file():
        # a FIFO or a device (/dev/zero): said as `dvfs cube info` says it, not "neither a
        # roofline file nor a cube (or it is damaged...)"; never opened, so never waited on
        raise click.UsageError(
            f"{source} is no regular file (a FIFO, a device), so neither a roofline file nor a "
            "cube: give the file `dvfs gpu roofline -o FILE` wrote, or the cube.nc a sweep "
            "wrote, or its folder"
        )
    if kind is None:
        raise click.UsageError(
            f"{source} is neither a roofline file (`dvfs gpu roofline -o FILE`) nor a cube "
            "(or it is damaged: a truncated cube is rebuilt from its journal with `dvfs cube "
            "build DIR`)"
        )
    if name is not None:
        _check_fit_name(name)
    make_parent(out_path)  # as `dvfs report -o` makes it, before the work as it does
    check_output(out_path)  # before the work, not after
    if kind == "cube":
        _fit_cube(source, out_path, base, name, max_cells)
    else:
        _fit_roofline(source, out_path, base, name)


def _link_into_no_folder(path: Path) -> bool:
    """Whether `path` is a symbolic link into a folder that does not exist, which the cube's
    build refuses to write through (`check_link_target`)."""
    from dvfs.errors import OutputRefusedError
    from dvfs.outputs import check_link_target

    try:
        check_link_target(path)
    except OutputRefusedError:
        return True
    return False


#: What a profile's name may not hold: a campaign's `gpu.profile` reads ':' as the start of a
#: trap list (`h100-sxm:none` is the shipped H100 without its traps), and the profile file's
#: `[gpu."<name>"]` header cannot hold a quote or a backslash.
_NOT_IN_A_NAME = (":", '"', "\\")


def _check_fit_name(name: str) -> None:
    """`--name`, before the fit: one a campaign would read as another profile (a trap list
    after ':'), or a shipped profile's (`twin predict` refuses it), or one the profile file
    cannot hold, is one line."""
    from dvfs.twin.profiles import gpu_profiles

    blank = bool(name) and not name.strip()  # "" is the default name; "  " names nothing
    if (
        blank
        or any(c in name for c in _NOT_IN_A_NAME)
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        fail(
            f"--name {name!r}: a profile's name cannot hold ':' (a campaign's gpu.profile reads "
            "what follows it as a trap list, as in h100-sxm:none), a quote, a backslash or a "
            "control character, nor be blank: choose another",
            2,
        )
    if name in gpu_profiles():
        fail(
            f"--name {name}: the twin ships a profile of that name, which `dvfs twin predict` "
            "would not replace with the fit: choose another",
            2,
        )


def _base_profile(attrs: dict[str, object], source: Path, base: str | None) -> GpuProfile:
    """`--base`, else a twin cube's own profile, else the measured GPU's by its name (the H100
    SXM's where the twin has none, said in `_base_note`). A real GPU's `twin_profile` (the
    hardware campaign's `gpu.profile`, the twin that estimated its time) is not its model."""
    from dvfs.twin.profiles import gpu_profile, profile_for_gpu_name, recorded_gpu_profile

    if base is not None:
        return gpu_profile(base)
    found = recorded_gpu_profile(attrs)
    if found is not None:
        return found
    if attrs.get("gpu_name"):
        return profile_for_gpu_name(str(attrs["gpu_name"]))
    raise click.UsageError(
        f"{source} names no GPU (measured with --device cpu?): choose the twin profile to "
        "fit with --base (h100-sxm, h200-sxm)"
    )


def _base_note(gpu_name: object, profile: GpuProfile, source: Path, *, raises: bool) -> str | None:
    """A note where the measured GPU is not the base profile's model (`--base` chose another,
    or the twin has no profile of it and the H100's stands in): the fit keeps that profile's
    peaks, memory and clocks, and reads the measurement against them. Allowed, not refused:
    `--base` is how a GPU the twin has no profile for is fitted at all. `raises`: the fit
    raises a peak the measurement outruns (a roofline's); a cube's fit keeps them."""
    from dvfs.twin.profiles import matching_gpu_profile

    measured = str(gpu_name or "").removesuffix(" (twin)").strip()
    own = matching_gpu_profile(measured)  # by whole words: an H20 is no H200
    if not measured or (own is not None and own.nvml_name == profile.nvml_name):
        return None
    peaks = (
        "peak FLOP/s, bandwidth (each raised where the measurement outruns it) and clocks"
        if raises
        else "peak FLOP/s, bandwidth and clocks (a cube fit raises neither: an efficiency "
        "stops at 1)"
    )
    return (
        f"{source} was measured on {str(gpu_name).removesuffix(' (twin)')}, the base profile "
        f"{profile.key} is the twin's {profile.nvml_name}: the fit keeps that GPU's {peaks} "
        "and reads the measurement against them; pass --base with the measured GPU's own "
        "profile where the twin has one"
    )


def _fit_roofline(source: Path, out_path: Path, base: str | None, name: str | None) -> None:
    from dvfs.outputs import write_text
    from dvfs.roofline import store
    from dvfs.twin.fit import fit_roofline, profile_toml

    ds = store.read(source)
    profile = _base_profile({"gpu_name": ds.attrs.get("gpu_name")}, source, base)
    result = fit_roofline(ds, profile, key=name, source=str(source))
    write_text(out_path, profile_toml(result))  # atomically: a failed write keeps the old one
    out = console()
    p = result.profile
    out.print(
        f"[bold]{escape(p.key)}[/bold] fitted from {escape(str(source))} (base {result.base})"
    )
    out.print(
        f"  gemm_efficiency {p.gemm_efficiency:.4g}, hbm_efficiency {p.hbm_efficiency:.4g}, "
        f"bandwidth knee {p.bandwidth_knee_mhz:g} MHz"
    )
    out.print(
        f"  power: idle {p.idle_power_w:.1f} W (+{p.idle_clock_power_w:.1f} W idling at the top "
        f"clock), SM {p.sm_active_power_w:.1f} W, tensor {p.tensor_power_w:.1f} W, memory "
        f"{p.memory_power_w:.1f} W"
    )
    residuals = ", ".join(f"{k} {v:.3g}" for k, v in result.residuals.items())
    out.print(f"  residuals: {residuals}")
    other = _base_note(ds.attrs.get("gpu_name"), profile, source, raises=True)
    for note in (*([other] if other else []), *result.notes):
        out.print(f"[yellow]note:[/yellow] {escape(note)}")
    out.print(f"wrote {escape(str(out_path))}")


def _open(source: Path) -> tuple[xr.Dataset, Path]:
    from dvfs.cube import open_cube
    from dvfs.cube.schema import CUBE_NAME

    path = source / CUBE_NAME if source.is_dir() else source
    return open_cube(path), path


def _fit_cube(
    source: Path, out_path: Path, base: str | None, name: str | None, max_cells: int
) -> None:
    from dvfs.cube.files import refuse_without_a_valid_cell
    from dvfs.outputs import write_text
    from dvfs.twin.fit import profile_toml
    from dvfs.twin.fitcube import fit_cube_cells
    from dvfs.twin.predict import OBSERVABLES, cube_cells

    ds, path = _open(source)
    if "valid" in ds:  # one without it is named among the variables the fit needs
        # as the analyses refuse it, saying what measures one, before the corpora are read
        refuse_without_a_valid_cell(source, ds, "nothing to fit")
    cells = cube_cells(ds, path, max_cells=max_cells)
    profile = _base_profile(dict(ds.attrs), source, base)
    result = fit_cube_cells(cells, profile, key=name, source=str(source))
    write_text(out_path, profile_toml(result))  # atomically: a failed write keeps the old one
    out = console()
    r = result.residuals
    out.print(
        f"[bold]{escape(result.profile.key)}[/bold] fitted from {escape(str(source))} (base "
        f"{result.base}): {r['cells']:.0f} cells, {r['solver_steps']:.0f} solver steps"
    )
    for field in result.fitted:
        value = float(getattr(result.profile, field))
        out.print(
            f"  {field} {value:.4g} (was {result.base_values[field]:.4g}, "
            f"\u00b1{result.std_errors[field]:.2g})"
        )
    for obs in OBSERVABLES:
        if f"{obs}_rel_rms" in r:
            out.print(
                f"  {obs}: rms error {r[f'{obs}_rel_rms']:.2%}, worst "
                f"{r[f'{obs}_rel_worst']:+.2%} at {escape(result.worst_cells[obs])}"
            )
    other = _base_note(ds.attrs.get("gpu_name"), profile, source, raises=False)
    for note in (*([other] if other else []), *result.notes):
        out.print(f"[yellow]note:[/yellow] {escape(note)}")
    for warning in result.warnings:
        out.print(f"[bold yellow]warning:[/bold yellow] {escape(warning)}")
    out.print(f"wrote {escape(str(out_path))}")


@twin.command("predict")
@click.argument(
    "campaign_path",
    type=ExistingPath(dir_okay=False),
    metavar="CAMPAIGN",
)
@click.option(
    "--profile",
    "profile_path",
    type=ExistingPath(dir_okay=False),
    required=True,
    help="Profile TOML from `dvfs twin fit`.",
)
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputFolder(cube=True),
    required=True,
    help="Sweep folder to write (journal and cube.nc).",
)
@click.option("--fresh", is_flag=True, help="Move an earlier journal in the folder aside first.")
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
@handle_errors
def predict(
    campaign_path: Path, profile_path: Path, out_dir: Path, fresh: bool, no_progress: bool
) -> None:
    """Predict CAMPAIGN's cube on the twin with a fitted GPU profile: the campaign is swept on
    the twin (its GPU and engine switched to the twin, the profile's GPU, virtual time) into
    OUT/cube.nc, as `dvfs sweep` would."""
    from dvfs.campaign import load_campaign
    from dvfs.cli.common import sweep_groups
    from dvfs.cli.sweep import run, run_fleet
    from dvfs.dry_run import twin_stand_in
    from dvfs.errors import CampaignError
    from dvfs.fleet.folders import fleet_journal
    from dvfs.twin.fit import load_profile, profile_digest, registered_profile

    campaign = load_campaign(campaign_path)
    profile = load_profile(profile_path)
    if (
        not profile.key.strip()
        or any(c in profile.key for c in _NOT_IN_A_NAME)
        or any(ord(c) < 32 or ord(c) == 127 for c in profile.key)
    ):
        # `h100-sxm:none` would run the shipped H100 without its traps, the file's figures
        # unused, and an empty name the campaign's own `gpu.profile`; a control character
        # (which `fit --name` refuses) would go into every line that names the profile
        raise CampaignError(
            f"{profile_path} [gpu.{profile.key!r}]: a campaign cannot name this profile (a "
            "profile's name is not blank and holds no ':', which starts a trap list, nor a quote, "
            "a backslash or a control character): rename the table, or fit again with `dvfs "
            "twin fit --name`"
        )
    digest = profile_digest(profile)  # before it is lent, when it would pass for shipped
    # the campaign's trap list (`h100-sxm:none`) says which of NVML's traps to simulate: it
    # applies to the profile the campaign is predicted on, as to its own
    traps = (campaign.gpu.profile or "").partition(":")[2]
    with registered_profile(profile) as key:
        key = f"{key}:{traps}" if traps else key
        stand_in, _, _ = twin_stand_in(campaign, key, profile_digest=digest)
        _check_knobs(stand_in, profile, campaign_path, profile_path)
        # as `dvfs sweep` runs it: a campaign of several gpu.devices groups (or a folder a
        # fleet journals in) on one worker and server per group, not one server on them all
        groups = sweep_groups(stand_in, None)
        if len(groups) > 1 or (not fresh and fleet_journal(out_dir)):
            outcome = run_fleet(stand_in, out_dir, groups, fresh=fresh, progress=not no_progress)
        else:
            outcome = run(stand_in, out_dir, fresh=fresh, progress=not no_progress)
    if outcome.summary.failed:
        raise SystemExit(5)


def _check_knobs(
    campaign: Campaign, profile: GpuProfile, campaign_path: Path, profile_path: Path
) -> None:
    """The campaign's clocks and power limits against the profile it is predicted on, as a
    twin campaign's are against its own `gpu.profile` when it loads: the campaign was checked
    against its own GPU only (or none, on hardware), and a fit keeps its base's clocks."""
    from dvfs.errors import CampaignError
    from dvfs.gpu.base import unsupported_clock

    whose = f" of the profile {profile.key} ({profile_path})"
    supported = set(profile.supported_sm_clocks_mhz())
    for clock in campaign.knobs.sm_clocks_mhz or ():
        problem = unsupported_clock(clock, supported, of=whose)
        if problem:
            raise CampaignError(
                f"{campaign_path}: knobs.sm_clock: {problem}, in {profile.sm_clock_step_mhz} "
                "MHz steps"
            )
    allowed = profile.power_limit_range()
    for limit in campaign.knobs.power_limits_w or ():
        problem = allowed.outside(limit * 1000)
        if problem:
            raise CampaignError(f"{campaign_path}: knobs.power_limit: {problem}{whose}")
