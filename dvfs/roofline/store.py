"""The roofline file: a small netCDF (schema dvfs.roofline/1), and its JSON and table views.

Dimensions `setting` ("stock", then each locked clock in MHz) and `kernel`. Per setting the
file holds the achieved peak FLOP/s (best GEMM), the bandwidth (best of triad and copy), their
ratio the ridge point, and joules per FLOP and per byte; per kernel and setting the time, rates,
power and each GEMM's efficiency relative to that peak (its M-dependence is what the twin needs).
Everything here is a pure function of the measurements except `write` and `read`.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.errors import DvfsError

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.roofline.run import RooflineRun

SCHEMA = "dvfs.roofline/1"


class RooflineFileError(DvfsError):
    """A roofline file is missing, unreadable or of another schema."""


def build_dataset(run: RooflineRun) -> xr.Dataset:
    """The measurements as a Dataset, with the per-setting roofline derived from them."""
    import xarray as xr

    kernels = [r.kernel for r in run.points[0].results]
    seconds = np.array([[r.seconds for r in p.results] for p in run.points], dtype=float)
    power = np.array([[r.power_w for r in p.results] for p in run.points], dtype=float)
    seen = np.array([[r.sm_clock_mhz for r in p.results] for p in run.points], dtype=float)
    hot = np.array([[r.temperature_c for r in p.results] for p in run.points], dtype=float)
    flops = np.array([k.flops for k in kernels])
    bytes_ = np.array([k.bytes for k in kernels])
    dims = ("setting", "kernel")
    ds = xr.Dataset(
        {
            "seconds": (dims, seconds, {"units": "s", "long_name": "time per call"}),
            "power_w": (dims, power, {"units": "W", "long_name": "board power while running"}),
            "observed_sm_clock_mhz": (
                dims,
                seen,
                {"units": "MHz", "long_name": "SM clock read while the kernel ran"},
            ),
            "temperature_c": (
                dims,
                hot,
                {"units": "degC", "long_name": "die temperature read while the kernel ran"},
            ),
            "flops": ("kernel", flops, {"units": "FLOP", "long_name": "FLOPs per call"}),
            "bytes": ("kernel", bytes_, {"units": "byte", "long_name": "minimum bytes per call"}),
            "sm_clock_mhz": (
                "setting",
                np.array([p.sm_clock_mhz for p in run.points], dtype=float),
                {"units": "MHz", "long_name": "locked SM clock (stock: highest observed)"},
            ),
            "locked": ("setting", np.array([int(p.locked) for p in run.points], dtype=np.int8)),
            "power_limit_w": (
                "setting",
                np.array([p.power_limit_w for p in run.points], dtype=float),
                {"units": "W"},
            ),
        },
        coords={
            "setting": [p.setting for p in run.points],
            "kernel": [k.name for k in kernels],
            "kind": ("kernel", [k.kind for k in kernels]),
            "m": ("kernel", np.array([k.m for k in kernels], dtype=np.int64)),
            "n": ("kernel", np.array([k.n for k in kernels], dtype=np.int64)),
            "k": ("kernel", np.array([k.k for k in kernels], dtype=np.int64)),
        },
        attrs={"schema": SCHEMA, **run.attrs, "notes": "\n".join(run.notes)},
    )
    return derive(ds)


def derive(ds: xr.Dataset) -> xr.Dataset:
    """Rates, energy, GEMM efficiency and the roofline per setting from seconds and power."""
    out = ds.copy()
    dims = ("setting", "kernel")
    out["flop_s"] = (ds["flops"] / ds["seconds"]).transpose(*dims).assign_attrs(units="FLOP s-1")
    out["bytes_s"] = (ds["bytes"] / ds["seconds"]).transpose(*dims).assign_attrs(units="byte s-1")
    out["energy_j"] = (ds["power_w"] * ds["seconds"]).assign_attrs(
        units="J", long_name="energy per call"
    )
    gemm = ds["kind"] == "gemm"
    peak_kernel = out["flop_s"].where(gemm).fillna(-1.0).argmax("kernel")
    bw_kernel = out["bytes_s"].where(ds["kind"] == "bandwidth").fillna(-1.0).argmax("kernel")
    out["peak_flop_s"] = (
        out["flop_s"].isel(kernel=peak_kernel).drop_vars(["kernel", "kind", "m", "n", "k"])
    )
    out["peak_flop_s"].attrs = {"units": "FLOP s-1", "long_name": "best GEMM's FLOP/s"}
    out["bandwidth_bytes_s"] = (
        out["bytes_s"].isel(kernel=bw_kernel).drop_vars(["kernel", "kind", "m", "n", "k"])
    )
    out["bandwidth_bytes_s"].attrs = {"units": "byte s-1", "long_name": "best of triad and copy"}
    out["ridge_point"] = (out["peak_flop_s"] / out["bandwidth_bytes_s"]).assign_attrs(
        units="FLOP byte-1", long_name="measured ridge point: peak FLOP/s over bandwidth"
    )
    out["gemm_efficiency"] = (
        (out["flop_s"] / out["peak_flop_s"])
        .where(gemm)
        .assign_attrs(units="1", long_name="GEMM FLOP/s relative to the best GEMM at this setting")
    )
    for name, kernel in (("peak_power_w", peak_kernel), ("bandwidth_power_w", bw_kernel)):
        out[name] = (
            ds["power_w"]
            .isel(kernel=kernel)
            .drop_vars(["kernel", "kind", "m", "n", "k"])
            .assign_attrs(units="W", long_name="power while the best kernel ran")
        )
    energy = out["energy_j"]
    out["j_per_flop"] = (
        (energy.isel(kernel=peak_kernel) / ds["flops"].isel(kernel=peak_kernel))
        .drop_vars(["kernel", "kind", "m", "n", "k"])
        .assign_attrs(units="J FLOP-1")
    )
    out["j_per_byte"] = (
        (energy.isel(kernel=bw_kernel) / ds["bytes"].isel(kernel=bw_kernel))
        .drop_vars(["kernel", "kind", "m", "n", "k"])
        .assign_attrs(units="J byte-1")
    )
    return out


#: The variables a roofline file holds: what was measured (the rest is derived on reading).
MEASURED = (
    "seconds",
    "power_w",
    "observed_sm_clock_mhz",
    "flops",
    "bytes",
    "sm_clock_mhz",
    "locked",
    "power_limit_w",
)
#: Measured variables a file from an earlier dvfs may lack (`dvfs.twin.fit` says what follows).
OPTIONAL = ("temperature_c",)


def write(ds: xr.Dataset, path: Path) -> Path:
    """The netCDF file (measured variables only: the rest is derived again on reading),
    replaced atomically: a failed write keeps the file that was there."""
    from dvfs.outputs import write_netcdf

    measured = ds[list(MEASURED) + [name for name in OPTIONAL if name in ds.variables]]
    try:
        write_netcdf(path, measured.to_netcdf, int(measured.nbytes))
    except RuntimeError as exc:  # netCDF-C's other failed writes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RooflineFileError(f"cannot write {path}: {first}") from exc
    return path


def read(path: Path) -> xr.Dataset:
    """A roofline file, derived variables recomputed; one clear line when it is not one."""
    import xarray as xr

    if not path.exists():
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # not "no roofline file": one written there fails too
                raise RooflineFileError(
                    f"{path} is a symbolic link in a loop (it leads back to itself), not a "
                    "roofline file: remove the link, or give the file `dvfs gpu roofline -o "
                    "FILE` wrote"
                ) from None
        raise RooflineFileError(f"no roofline file at {path} (write one with `dvfs gpu roofline`)")
    if not path.is_file():  # netCDF is read by seeking: a FIFO would be waited on for ever
        raise RooflineFileError(
            f"{path} is no regular file (a folder, a FIFO, a device), so no roofline file: give "
            "the file `dvfs gpu roofline -o FILE` wrote"
        )
    try:
        with path.open("rb") as file:
            head = file.read(64).lstrip()
    except OSError as exc:
        raise RooflineFileError(
            f"{path} cannot be read ({exc.strerror or exc}): give a roofline file you may read"
        ) from exc
    if head.startswith((b"{", b"[")):
        raise RooflineFileError(
            f"{path} is JSON, not a roofline file (`dvfs gpu roofline --json` prints one's "
            "view): give the netCDF file `dvfs gpu roofline -o FILE` wrote"
        )
    from dvfs.outputs import netcdf_path_problem

    problem = netcdf_path_problem(path, writing=False)
    if problem:
        raise RooflineFileError(problem)
    try:
        with xr.open_dataset(path, engine="netcdf4") as opened:
            ds = opened.load()
    except (OSError, ValueError) as exc:
        raise RooflineFileError(
            f"{path} is not a readable netCDF file ({exc}): give a roofline file that "
            "`dvfs gpu roofline -o FILE` wrote"
        ) from exc
    if ds.attrs.get("schema") != SCHEMA:
        raise RooflineFileError(
            f"{path} is not a dvfs roofline file (schema {ds.attrs.get('schema')!r}, "
            f"expected {SCHEMA!r}): give a roofline file that `dvfs gpu roofline -o FILE` wrote"
        )
    missing = [name for name in MEASURED + ("kind", "m", "n", "k") if name not in ds.variables]
    grid = {"setting", "kernel"}
    off_grid = [name for name in OPTIONAL if name in ds.variables and set(ds[name].dims) != grid]
    if missing or off_grid or set(ds["seconds"].dims) != grid:
        missing += [f"{name} on (setting, kernel)" for name in off_grid]
        raise RooflineFileError(
            f"{path} is a damaged roofline file (missing {', '.join(missing) or 'dimensions'}): "
            "measure again with `dvfs gpu roofline -o FILE`"
        )
    problem = _attribute_problem(ds)
    if problem:
        raise RooflineFileError(
            f"{path} is a damaged roofline file ({problem}): measure again with "
            "`dvfs gpu roofline -o FILE`"
        )
    try:
        return derive(ds)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise RooflineFileError(
            f"{path} is a damaged roofline file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): measure again with "
            "`dvfs gpu roofline -o FILE`"
        ) from exc


#: The attributes naming the GPU a roofline was measured on, which compare and twin fit read
#: as text.
TEXT_ATTRIBUTES = ("device", "device_name", "gpu_name", "twin_profile")


def _attribute_problem(ds: xr.Dataset) -> str | None:
    """What keeps a roofline's settings and names from being read (None when nothing): no
    setting measured, an infinite SM clock (NaN is one not known), a GPU name that is no
    text (a number, a list)."""
    if ds.sizes.get("setting", 0) == 0:
        return "no setting measured"
    try:
        clocks = np.asarray(ds["sm_clock_mhz"].values, dtype=float)
    except (TypeError, ValueError):
        return "sm_clock_mhz holds no numbers"
    if np.isinf(clocks).any():
        return "an infinite sm_clock_mhz"
    for name in TEXT_ATTRIBUTES:
        value = ds.attrs.get(name)
        if value is not None and not isinstance(value, str):
            shown = repr(value.tolist() if hasattr(value, "tolist") else value)
            return f"its {name} attribute holds {shown[:60]}, not text"
    return None


def _number(value: Any) -> float | None:
    x = float(value)
    return None if math.isnan(x) else x


def document(ds: xr.Dataset) -> dict[str, Any]:
    """The JSON view (NaN as null): attributes, notes, and per setting its roofline and kernels."""
    attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in ds.attrs.items()}
    notes = [n for n in str(attrs.pop("notes", "")).split("\n") if n]
    settings = []
    for setting in ds["setting"].values:
        at = ds.sel(setting=setting)
        settings.append(
            {
                "setting": str(setting),
                "sm_clock_mhz": _number(at["sm_clock_mhz"]),
                "locked": bool(at["locked"]),
                "power_limit_w": _number(at["power_limit_w"]),
                "peak_flop_s": _number(at["peak_flop_s"]),
                "bandwidth_bytes_s": _number(at["bandwidth_bytes_s"]),
                "ridge_point": _number(at["ridge_point"]),
                "peak_power_w": _number(at["peak_power_w"]),
                "bandwidth_power_w": _number(at["bandwidth_power_w"]),
                "j_per_flop": _number(at["j_per_flop"]),
                "j_per_byte": _number(at["j_per_byte"]),
                "kernels": [
                    {
                        "kernel": str(kernel),
                        "kind": str(at["kind"].sel(kernel=kernel).values),
                        "m": int(at["m"].sel(kernel=kernel)),
                        "n": int(at["n"].sel(kernel=kernel)),
                        "k": int(at["k"].sel(kernel=kernel)),
                        "seconds": _number(at["seconds"].sel(kernel=kernel)),
                        "flop_s": _number(at["flop_s"].sel(kernel=kernel)),
                        "bytes_s": _number(at["bytes_s"].sel(kernel=kernel)),
                        "gemm_efficiency": _number(at["gemm_efficiency"].sel(kernel=kernel)),
                        "power_w": _number(at["power_w"].sel(kernel=kernel)),
                        "sm_clock_mhz": _number(at["observed_sm_clock_mhz"].sel(kernel=kernel)),
                        "temperature_c": (
                            _number(at["temperature_c"].sel(kernel=kernel))
                            if "temperature_c" in ds.variables
                            else None
                        ),
                        "energy_j": _number(at["energy_j"].sel(kernel=kernel)),
                    }
                    for kernel in ds["kernel"].values
                ],
            }
        )
    return {"schema": SCHEMA, **attrs, "notes": notes, "settings": settings}


def _si(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def summary_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per setting: clock, peak FLOP/s, bandwidth, ridge, power and J per FLOP/byte."""
    header = ["setting", "SM clock", "peak", "bandwidth", "ridge", "GEMM W", "bandwidth W"]
    header += ["pJ/FLOP", "pJ/byte"]
    rows = []
    for s in doc["settings"]:
        clock = s["sm_clock_mhz"]
        rows.append(
            [
                s["setting"],
                "n/a" if clock is None else f"{clock:.0f} MHz",
                _si(s["peak_flop_s"], "FLOP/s"),
                _si(s["bandwidth_bytes_s"], "B/s"),
                "n/a" if s["ridge_point"] is None else f"{s['ridge_point']:.1f} FLOP/B",
                "NaN" if s["peak_power_w"] is None else f"{s['peak_power_w']:.0f}",
                "NaN" if s["bandwidth_power_w"] is None else f"{s['bandwidth_power_w']:.0f}",
                "NaN" if s["j_per_flop"] is None else f"{s['j_per_flop'] * 1e12:.3g}",
                "NaN" if s["j_per_byte"] is None else f"{s['j_per_byte'] * 1e12:.3g}",
            ]
        )
    return header, rows


def efficiency_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """GEMM efficiency by token count M at the first setting, one column per GEMM shape."""
    kernels = [k for k in doc["settings"][0]["kernels"] if k["kind"] == "gemm"]
    shapes = sorted({k["kernel"].split("-")[1] for k in kernels})
    tokens = sorted({k["m"] for k in kernels})
    header = ["M", *(f"{s} eff." for s in shapes), *(f"{s} FLOP/s" for s in shapes)]
    by = {(k["kernel"].split("-")[1], k["m"]): k for k in kernels}
    rows = []
    for m in tokens:
        eff = [by[(s, m)]["gemm_efficiency"] for s in shapes]
        rate = [by[(s, m)]["flop_s"] for s in shapes]
        rows.append(
            [
                str(m),
                *("n/a" if e is None else f"{e:.3f}" for e in eff),
                *(_si(r, "") for r in rate),
            ]
        )
    return header, rows


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2)
