"""`dvfs twin`: calibrate the digital twin from measurements.

`dvfs twin fit` takes a roofline file today; a sweep cube is recognised and refused in one line
until the cube fit (issue 13) is built, so the command's shape does not change when it comes.
"""

from __future__ import annotations

from pathlib import Path

import click

from dvfs.cli.common import console, escape, handle_errors


@click.group()
def twin() -> None:
    """The digital twin: fit it to measurements."""


@twin.command("fit")
@click.argument("source", type=click.Path(exists=True, path_type=Path), metavar="ROOFLINE_OR_CUBE")
@click.option(
    "-o",
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Profile TOML to write.",
)
@click.option(
    "--base",
    help="Twin GPU profile whose other figures are kept [default: the one matching the "
    "measured GPU's name].",
)
@click.option("--name", help="Key of the fitted profile [default: <base>-fit].")
@handle_errors
def fit(source: Path, out_path: Path, base: str | None, name: str | None) -> None:
    """Fit the twin's GPU to ROOFLINE_OR_CUBE: from a `dvfs gpu roofline` file, the compute and
    memory efficiencies (with GEMM efficiency by token count), the bandwidth knee and the power
    coefficients; writes a profile TOML and prints how well it reproduces the measurements."""
    from dvfs.roofline import store
    from dvfs.twin.fit import fit_input_kind, fit_roofline, profile_toml
    from dvfs.twin.profiles import gpu_profile, profile_for_gpu_name

    kind = fit_input_kind(source)
    if kind == "cube":
        raise click.UsageError(
            f"{source} is a sweep cube; fitting the twin to a cube is not built yet (issue 13): "
            "give a roofline file from `dvfs gpu roofline -o FILE`"
        )
    if kind is None:
        raise click.UsageError(
            f"{source} is neither a roofline file (`dvfs gpu roofline -o FILE`) nor a cube"
        )
    ds = store.read(source)
    if base is not None:
        profile = gpu_profile(base)
    elif ds.attrs.get("gpu_name"):
        profile = profile_for_gpu_name(str(ds.attrs["gpu_name"]))
    else:
        raise click.UsageError(
            f"{source} names no GPU (measured with --device cpu?): choose the twin profile to "
            "fit with --base (h100-sxm, h200-sxm)"
        )
    result = fit_roofline(ds, profile, key=name, source=str(source))
    out_path.write_text(profile_toml(result), encoding="utf-8")
    out = console()
    p = result.profile
    out.print(
        f"[bold]{escape(p.key)}[/bold] fitted from {escape(str(source))} (base {profile.key})"
    )
    out.print(
        f"  gemm_efficiency {p.gemm_efficiency:.4g}, hbm_efficiency {p.hbm_efficiency:.4g}, "
        f"bandwidth knee {p.bandwidth_knee_mhz:g} MHz"
    )
    out.print(
        f"  power: idle {p.idle_power_w:.1f} W, SM {p.sm_active_power_w:.1f} W, tensor "
        f"{p.tensor_power_w:.1f} W, memory {p.memory_power_w:.1f} W"
    )
    residuals = ", ".join(f"{k} {v:.3g}" for k, v in result.residuals.items())
    out.print(f"  residuals: {residuals}")
    for note in result.notes:
        out.print(f"[yellow]note:[/yellow] {escape(note)}")
    out.print(f"wrote {escape(str(out_path))}")
