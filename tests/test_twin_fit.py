"""`dvfs twin fit` from a roofline file: a roofline the twin's own physics "measured" with known
figures is fitted back to them, and the fitted twin's ridge point is the measured one; `dvfs
compare --roofline` places the measured ridge on the cube's clocks. No torch needed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.roofline import store
from dvfs.roofline.kernels import BenchSpec, plan_kernels
from dvfs.roofline.run import KernelResult, Point, RooflineRun
from dvfs.twin import physics, traps
from dvfs.twin.fit import achievable_ridge_point, fit_roofline, load_profile, profile_toml
from dvfs.twin.physics import Passes
from dvfs.twin.profiles import GpuProfile, gpu_profile
from dvfs.twin.timeline import thermal_of

H100 = gpu_profile("h100-sxm")
CLOCKS = (1980, 1590, 1200, 900, 600)
FITTED = (
    "gemm_efficiency",
    "hbm_efficiency",
    "bandwidth_knee_mhz",
    "idle_power_w",
    "sm_active_power_w",
    "tensor_power_w",
    "memory_power_w",
)


def true_profile(**changes: float) -> GpuProfile:
    """H100 with other figures, and no per-pass overheads (a microbenchmark has none)."""
    defaults = {
        "gemm_efficiency": 0.72,
        "hbm_efficiency": 0.81,
        "bandwidth_knee_mhz": 1000.0,
        "idle_power_w": 70.0,
        "sm_active_power_w": 80.0,
        "tensor_power_w": 500.0,
        "memory_power_w": 120.0,
    }
    return dataclasses.replace(
        H100,
        key="true",
        kernel_cycles_per_layer=0.0,
        host_overhead_s=0.0,
        **{**defaults, **changes},
    )


def twin_roofline(
    profile: GpuProfile,
    clocks=CLOCKS,
    energy: bool = True,
    gemm_cap_mhz: float = 1e9,
    tokens: tuple[int, ...] = (1, 16, 256, 4096, 16384),
    heating: bool = False,
):
    """The roofline file the twin's physics would produce: each kernel's time, power and clock
    (GEMMs held to `gemm_cap_mhz`, as a power limit holds big GEMMs below their lock). With
    `heating` the die warms over the run towards each kernel's steady temperature, and each
    power holds the profile's leakage at the temperature recorded with it, as on a GPU."""
    thermal = thermal_of(profile)
    spec = BenchSpec(
        device="cuda",
        dtype="bfloat16",
        hidden=4096,
        intermediate=14336,
        tokens=tokens,
        bandwidth_elements=2**29,
    )
    points = []
    for i, f in enumerate(clocks):
        results = []
        for kernel in plan_kernels(spec):
            one = np.ones(1)
            m = kernel.m * one if kernel.kind == "gemm" else 0 * one  # GEMM efficiency at M
            passes = Passes(kernel.flops * one, kernel.bytes * one, *(0 * one,) * 3, tokens=m)
            ran = min(f, gemm_cap_mhz) if kernel.kind == "gemm" else f
            timing = physics.time_passes(profile, passes, ran)
            power = float(timing.power_w[0]) if energy else float("nan")
            hot = thermal.reference_c
            if heating:  # a one-second window each, with the die's time constant
                warmed = 1.0 - np.exp(-(len(results) + 1.0) / profile.thermal_time_constant_s)
                hot += (float(thermal.steady_c(power)) - thermal.reference_c) * warmed
                power = float(thermal.power_w(power, hot))
            results.append(KernelResult(kernel, float(timing.duration_s[0]), power, ran, hot))
        points.append(Point("stock" if i == 0 else str(f), i > 0, float(f), 700.0, tuple(results)))
    attrs = {"device": "cuda", "device_name": profile.nvml_name, "dtype": "bfloat16"}
    attrs.update(gpu_name=profile.nvml_name, hidden=4096, intermediate=14336)
    if energy:
        attrs["idle_power_w"] = profile.idle_power_w
        attrs["idle_temperature_c"] = thermal.reference_c
    return store.build_dataset(RooflineRun(tuple(points), attrs, ()))


def test_fit_recovers_the_twins_figures_and_ridge() -> None:
    truth = true_profile()
    ds = twin_roofline(truth)
    fit = fit_roofline(ds, H100)
    assert fit.fitted == FITTED
    for name in FITTED:
        assert getattr(fit.profile, name) == pytest.approx(getattr(truth, name), rel=0.01), name
    for f, measured in zip(CLOCKS, ds["ridge_point"].values, strict=True):
        assert achievable_ridge_point(fit.profile, f) == pytest.approx(measured, rel=0.005)
    assert fit.residuals["ridge_rel_max"] < 0.005
    # The ridge falls with the clock below the knee less than the FLOP/s do.
    assert ds["ridge_point"].values[0] > ds["ridge_point"].values[-1]


def test_a_power_capped_gemm_is_fitted_at_the_clock_it_ran_at() -> None:
    truth = true_profile()
    fit = fit_roofline(twin_roofline(truth, gemm_cap_mhz=1500), H100)
    assert fit.profile.gemm_efficiency == pytest.approx(0.72, rel=0.01)
    assert fit.profile.tensor_power_w == pytest.approx(500, rel=0.01)
    assert any("ran below the setting's clock at 2 setting(s)" in n for n in fit.notes)
    assert fit.gemm_efficiency_by_tokens["up"][-1] == pytest.approx(0.72, rel=0.01)


@pytest.mark.parametrize("idle_read_at", [345.0, 1980.0, 1500.0])
def test_the_idle_power_is_the_idle_clocks_and_a_raised_reading_gives_the_clock_power(
    idle_read_at: float,
) -> None:
    """A GPU stays clocked up after work (an H200 read 130 W at 1980 MHz there, 80 W at its
    345 MHz idle clock): the twin's idle power is the idle clock's, so a reading at a raised
    clock has the base's idle-clock power taken off, and the reading right after the kernels
    gives the idle-clock power."""
    truth = true_profile(idle_clock_power_w=48.0)
    base = dataclasses.replace(H100, idle_clock_power_w=48.0)
    ds = twin_roofline(truth)
    ds.attrs.update(
        idle_power_w=traps.idle_power_w(truth, idle_read_at),
        idle_sm_clock_mhz=idle_read_at,
        raised_idle_power_w=traps.idle_power_w(truth, 1890.0),
        raised_idle_sm_clock_mhz=1890.0,
    )
    fit = fit_roofline(ds, base)
    assert fit.profile.idle_power_w == pytest.approx(truth.idle_power_w, rel=1e-9)
    assert fit.profile.idle_clock_power_w == pytest.approx(48.0, rel=1e-9)
    assert fit.fitted == (*FITTED[:4], "idle_clock_power_w", *FITTED[4:])
    for name in FITTED:
        assert getattr(fit.profile, name) == pytest.approx(getattr(truth, name), rel=0.01), name
    taken_off = [n for n in fit.notes if "is taken off" in n]
    assert bool(taken_off) == (idle_read_at > truth.idle_sm_clock_mhz)


def test_the_leakage_a_recorded_temperature_rise_drew_is_taken_off_the_power_fit() -> None:
    """A GPU's kernels heat its die and each reading holds that temperature's leakage: with
    the temperatures recorded, the base's leakage over the idle temperature is taken off, the
    dynamic figures come back and the twin keeps its leakage to add as its die heats (fitted
    as read, they took in up to ~12 W of leakage, which the twin then added again)."""
    truth = true_profile()
    ds = twin_roofline(truth, heating=True)
    rise = ds["temperature_c"] - ds.attrs["idle_temperature_c"]
    assert float(rise.max()) > 10.0  # the file holds a real rise, and its leakage
    fit = fit_roofline(ds, H100)
    for name in FITTED:
        assert getattr(fit.profile, name) == pytest.approx(getattr(truth, name), rel=0.01), name
    assert fit.profile.leakage_w_per_c == H100.leakage_w_per_c > 0
    assert any("leakage off the idle temperature" in n for n in fit.notes)


def test_without_temperatures_the_leakage_is_not_counted_twice(tmp_path: Path) -> None:
    """A roofline from an earlier dvfs records no temperatures: its powers hold the leakage,
    the fitted power figures take it in, so the profile's leakage is 0 (and said), as a cube
    fit's is."""
    ds = twin_roofline(true_profile(), heating=True).drop_vars("temperature_c")
    fit = fit_roofline(ds, H100)
    assert H100.leakage_w_per_c > 0 and fit.profile.leakage_w_per_c == 0.0
    assert any("records no temperatures" in n and "is set to 0" in n for n in fit.notes)
    # the file without them still reads and fits through the CLI
    path = store.write(ds, tmp_path / "earlier.nc")
    out = tmp_path / "fitted.toml"
    result = CliRunner().invoke(cli, ["twin", "fit", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert load_profile(out).leakage_w_per_c == 0.0


def test_an_idle_reading_of_unknown_clock_is_kept_and_said() -> None:
    """A roofline file from before the idle clock was recorded: its idle power is kept as read
    (it may be a raised clock's), and the fit says so; the idle-clock power stays the base's."""
    ds = twin_roofline(true_profile())
    assert "idle_sm_clock_mhz" not in ds.attrs
    fit = fit_roofline(ds, H100)
    assert fit.profile.idle_power_w == ds.attrs["idle_power_w"]
    assert fit.profile.idle_clock_power_w == H100.idle_clock_power_w
    assert any("at which SM clock its idle power was read" in n for n in fit.notes)
    assert any("idle_clock_power_w kept from h100-sxm" in n for n in fit.notes)


def test_a_roofline_of_few_rows_fits_the_large_m_efficiency_or_keeps_the_base() -> None:
    """`dvfs gpu roofline --tokens` may stop short of large M: the profile's GEMM efficiency
    is the large-M figure the twin quantises again by M, so the best GEMM's quantisation is
    undone, and a run whose GEMMs were all memory-bound keeps the base's and says so (it
    read a bandwidth-bound GEMM's FLOP/s as the GEMM efficiency, 0.17 for 0.72)."""
    truth = true_profile()
    for tokens in ((1, 512), (1, 16, 640)):
        fit = fit_roofline(twin_roofline(truth, tokens=tokens), H100)
        assert fit.profile.gemm_efficiency == pytest.approx(truth.gemm_efficiency, rel=1e-6)
        assert fit.profile.tensor_power_w == pytest.approx(truth.tensor_power_w, rel=1e-6)
    fit = fit_roofline(twin_roofline(truth, clocks=(1980,), tokens=(1, 16, 64)), H100)
    assert fit.profile.gemm_efficiency == H100.gemm_efficiency
    assert (
        f"no GEMM ran compute-bound (the largest M is 64): gemm_efficiency kept from "
        f"{H100.key}; measure with larger --tokens"
    ) in fit.notes
    # its power figures follow the tensor utilisation at that efficiency, as the twin's do
    assert fit.profile.sm_active_power_w == pytest.approx(truth.sm_active_power_w, rel=1e-6)


def test_gemm_efficiency_by_tokens_rises_with_m() -> None:
    fit = fit_roofline(twin_roofline(true_profile()), H100)
    assert fit.gemm_tokens == (1, 16, 256, 4096, 16384)
    for curve in fit.gemm_efficiency_by_tokens.values():
        assert all(a < b for a, b in zip(curve[:3], curve[1:4], strict=True))
        assert curve[-1] == pytest.approx(0.72, rel=0.01)


@settings(max_examples=15, deadline=None)
@given(
    gemm=st.floats(0.4, 0.95),
    hbm=st.floats(0.5, 0.95),
    knee=st.integers(120, 280).map(lambda k: 5.0 * k),
    sm=st.floats(20, 150),
    tensor=st.floats(100, 600),
    memory=st.floats(30, 200),
)
def test_fit_recovers_any_figures(gemm, hbm, knee, sm, tensor, memory) -> None:
    truth = true_profile(
        gemm_efficiency=gemm,
        hbm_efficiency=hbm,
        bandwidth_knee_mhz=knee,
        sm_active_power_w=sm,
        tensor_power_w=tensor,
        memory_power_w=memory,
    )
    fit = fit_roofline(twin_roofline(truth), H100)
    for name in FITTED:
        assert getattr(fit.profile, name) == pytest.approx(getattr(truth, name), rel=0.03), name


def test_without_energy_or_clocks_the_base_is_kept_and_said() -> None:
    ds = twin_roofline(true_profile(), clocks=(1980,), energy=False)
    fit = fit_roofline(ds, H100)
    assert fit.fitted == ("gemm_efficiency", "hbm_efficiency", "bandwidth_knee_mhz")
    assert fit.profile.tensor_power_w == H100.tensor_power_w
    assert fit.profile.bandwidth_knee_mhz == H100.bandwidth_knee_mhz
    assert any("no energy" in n for n in fit.notes) and any("one clock" in n for n in fit.notes)
    # the fitted twin measures the file's roofline again (its best GEMM, at its M, included)
    again = twin_roofline(
        dataclasses.replace(fit.profile, kernel_cycles_per_layer=0.0, host_overhead_s=0.0),
        clocks=(1980,),
        energy=False,
    )
    assert float(again["ridge_point"].values[0]) == pytest.approx(
        float(ds["ridge_point"].values[0]), rel=1e-9
    )
    # the profile's figure is the large-M one: above the best GEMM's by its quantisation
    assert achievable_ridge_point(fit.profile, 1980) > float(ds["ridge_point"].values[0])


def test_profile_file_round_trips(tmp_path: Path) -> None:
    fit = fit_roofline(twin_roofline(true_profile()), H100, key="my-h100")
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(fit))
    assert load_profile(path) == fit.profile
    path.write_text(profile_toml(fit).replace("sm_count = 132\n", ""))
    from dvfs.errors import CampaignError

    with pytest.raises(CampaignError, match="missing \\['sm_count'\\]"):
        load_profile(path)
    # a value where the profile's table should be: said so, not "missing [], unknown []"
    path.write_text("[gpu]\nmy-h100 = 1\n")
    with pytest.raises(CampaignError, match=r"gpu\.my-h100 holds 1, not the \[gpu\.my-h100\]"):
        load_profile(path)


def test_a_roofline_with_a_kernel_missing_or_unmeasured_is_one_line_or_fitted(
    tmp_path: Path,
) -> None:
    """A file without a bandwidth kernel is refused in one line (its bandwidth was a GEMM's
    bytes/s, fitted as the HBM efficiency); a kernel whose time is NaN is left out (it was an
    internal error)."""
    ds = twin_roofline(true_profile())
    kinds = ds["kind"].values
    out = tmp_path / "fitted.toml"
    no_bandwidth = store.write(
        ds.isel(kernel=np.flatnonzero(kinds != "bandwidth")), tmp_path / "nb.nc"
    )
    result = CliRunner().invoke(cli, ["twin", "fit", str(no_bandwidth), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"Error: {no_bandwidth} has no bandwidth kernel (triad or copy): measure again with "
        "`dvfs gpu roofline -o FILE`"
    ]
    assert not out.exists()
    gemv = int(np.flatnonzero(kinds == "gemv")[0])
    unmeasured = ds.copy(deep=True)
    unmeasured["seconds"][:, gemv] = np.nan
    source = store.write(unmeasured, tmp_path / "nan.nc")
    result = CliRunner().invoke(cli, ["twin", "fit", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert load_profile(out).memory_power_w == pytest.approx(120.0, rel=1e-6)


def test_cli_fit_writes_a_loadable_profile(tmp_path: Path) -> None:
    source = store.write(twin_roofline(true_profile()), tmp_path / "roofline.nc")
    out = tmp_path / "fitted.toml"
    result = CliRunner().invoke(cli, ["twin", "fit", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "h100-sxm-fit fitted from" in result.output and "ridge_rel_max" in result.output
    assert load_profile(out).gemm_efficiency == pytest.approx(0.72, rel=0.01)


def test_cli_fit_of_a_cube_without_its_campaign_is_one_line(tmp_path: Path) -> None:
    """A cube is fitted cell by cell from the campaign it records (tests/test_twin_fit_cube.py):
    a hand-built cube has none, and says so in one line; a file that is neither kind is refused."""
    cube = tmp_path / "cube.nc"
    make_cube(clocks=[1980, 1500]).assign(
        decode_time_s=lambda d: d["energy_per_token_j"],
        output_tokens=lambda d: d["energy_per_token_j"],
        power_mean_w=lambda d: d["energy_per_token_j"],
    ).to_netcdf(cube)
    result = CliRunner().invoke(cli, ["twin", "fit", str(cube), "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 2, result.output
    assert "records no campaign" in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "p.toml").exists()
    garbage = tmp_path / "garbage.nc"
    garbage.write_text("not netCDF")
    result = CliRunner().invoke(cli, ["twin", "fit", str(garbage), "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 2 and "neither a roofline file" in result.output


def test_compare_uses_a_measured_ridge_file(small_sweep: Path, tmp_path: Path) -> None:
    from dvfs.analysis.roofline import measured_ridge

    ds = twin_roofline(true_profile())
    source = store.write(ds, tmp_path / "roofline.nc")
    result = CliRunner().invoke(
        cli, ["compare", str(small_sweep), "--roofline", str(source), "--json"]
    )
    assert result.exit_code == 0, result.output
    ridge = json.loads(result.stdout)["roofline"]["ridge_point"]
    clocks = np.array(sorted(int(c) for c in ridge), dtype=float)
    expected = measured_ridge(ds, clocks)
    np.testing.assert_allclose([ridge[str(int(c))] for c in clocks], expected)
    plain = CliRunner().invoke(cli, ["compare", str(small_sweep), "--json"])
    datasheet = json.loads(plain.stdout)["roofline"]["ridge_point"]
    assert datasheet != ridge


@settings(max_examples=50, deadline=None)
@given(
    points=st.dictionaries(
        st.integers(42, 132).map(lambda k: 15 * k), st.floats(1.0, 1000.0), min_size=1, max_size=6
    ),
    probe=st.floats(100.0, 2500.0),
)
def test_measured_ridge_passes_through_its_points_and_between_them(points, probe) -> None:
    import xarray as xr

    from dvfs.analysis.roofline import measured_ridge

    clocks = np.array(list(points), dtype=float)
    ridges = np.array(list(points.values()))
    ds = xr.Dataset({"sm_clock_mhz": ("setting", clocks), "ridge_point": ("setting", ridges)})
    np.testing.assert_allclose(measured_ridge(ds, clocks), ridges)
    [value] = measured_ridge(ds, np.array([probe]))
    lo, hi = clocks.min(), clocks.max()
    if lo <= probe <= hi:
        assert ridges.min() - 1e-9 <= value <= ridges.max() + 1e-9
    else:  # scaled with the clock from the nearest measured point
        edge = lo if probe < lo else hi
        assert value == pytest.approx(points[int(edge)] * probe / edge)


def test_compare_refuses_another_gpus_roofline_and_a_clockless_file(
    small_sweep: Path, tmp_path: Path
) -> None:
    """A roofline measured on another GPU model than the cube's would place that GPU's ridge
    on the cube's clocks (it was a warning above a table that mixed the two GPUs): refused in
    one line naming both; one measured on the cube's model is used, and named."""
    h200 = store.write(twin_roofline(gpu_profile("h200-sxm")), tmp_path / "h200.nc")
    for extra in ((), ("--json",)):
        result = CliRunner().invoke(
            cli, ["compare", str(small_sweep), "--roofline", str(h200), *extra]
        )
        assert result.exit_code == 1 and not result.stdout, result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "measured on NVIDIA H200, the cube on NVIDIA H100 80GB HBM3" in result.stderr
        assert "drop --roofline" in result.stderr
    same = store.write(twin_roofline(true_profile()), tmp_path / "h100.nc")
    result = CliRunner().invoke(cli, ["compare", str(small_sweep), "--roofline", str(same)])
    assert result.exit_code == 0 and "measured on" not in result.stderr
    # The table's title and the JSON name the measured ridge, never the twin's H100 profile.
    (title,) = [line for line in result.stdout.splitlines() if "ridge point" in line]
    assert "ridge measured (NVIDIA H100 80GB HBM3)" in title and "h100-sxm" not in title
    doc = CliRunner().invoke(cli, ["compare", str(small_sweep), "--roofline", str(same), "--json"])
    assert json.loads(doc.stdout)["roofline"]["ridge"] == "measured (NVIDIA H100 80GB HBM3)"
    clockless = twin_roofline(true_profile(), clocks=(1980,))
    clockless["sm_clock_mhz"][:] = np.nan
    path = store.write(clockless, tmp_path / "cpu.nc")
    result = CliRunner().invoke(cli, ["compare", str(small_sweep), "--roofline", str(path)])
    assert result.exit_code == 1 and "records no SM clock" in result.stderr


def test_a_merged_cube_takes_a_roofline_of_its_one_gpu_model_only() -> None:
    """A merged cube's GPUs are each checked (`gpu_names`), not only its first one's."""
    import xarray as xr

    from dvfs.analysis.roofline import check_measured
    from dvfs.errors import AnalysisError

    h100 = twin_roofline(true_profile())
    h100_name = str(h100.attrs["gpu_name"])

    def merged(*names: str) -> xr.Dataset:
        return xr.Dataset(
            coords={"gpu": [f"g{i}" for i in range(len(names))]},
            attrs={"gpu_name": names[0], "gpu_names": json.dumps(list(names))},
        )

    check_measured(h100, merged(h100_name, h100_name + " (twin)"))
    with pytest.raises(AnalysisError, match=f"the cube on {h100_name}, NVIDIA H200"):
        check_measured(h100, merged(h100_name, "NVIDIA H200"))


def test_the_twins_roofline_through_the_cli_fits_back_to_its_profile(tmp_path: Path) -> None:
    path = tmp_path / "twin.nc"
    args = ["gpu", "roofline", "--twin", "h200-sxm", "--clocks", "1500,1005,600"]
    result = CliRunner().invoke(cli, [*args, "--tokens", "1,256,4096", "-o", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [s["setting"] for s in doc["settings"]] == ["stock", "1500", "1005", "600"]
    assert all(s["j_per_flop"] > 0 and s["j_per_byte"] > 0 for s in doc["settings"])
    assert any("simulated by the digital twin" in n for n in doc["notes"])
    out = tmp_path / "fitted.toml"
    fitted = CliRunner().invoke(cli, ["twin", "fit", str(path), "-o", str(out)])
    assert fitted.exit_code == 0, fitted.output
    profile, h200 = load_profile(out), gpu_profile("h200-sxm")
    # the twin's roofline records its kernels at the idle temperature: no leakage to take off
    assert float(np.ptp(store.read(path)["temperature_c"].values)) == 0.0
    for name in (*FITTED, "idle_clock_power_w", "leakage_w_per_c"):
        assert getattr(profile, name) == pytest.approx(getattr(h200, name), rel=0.01), name
    text = CliRunner().invoke(cli, ["gpu", "roofline", "--twin", "h200-sxm", "--tokens", "1"])
    idle_c = thermal_of(h200).reference_c
    idle = (
        f"Idle: {h200.idle_power_w:.1f} W at {h200.idle_sm_clock_mhz} MHz, {idle_c:.0f} degC "
        "before the kernels"
    )
    assert text.exit_code == 0 and idle in text.output
    bad = CliRunner().invoke(cli, ["gpu", "roofline", "--twin", "h200-sxm", "--clocks", "1501"])
    assert bad.exit_code == 2 and "1501 MHz is not a supported SM clock of the twin" in bad.output
    # The twin's roofline is its GPU's at the model's sizes: a --device (which would shrink the
    # kernels to a CPU's) or a --gpu to measure contradicts it.
    for extra in (["--device", "cpu"], ["--gpu", "0"]):
        mixed = CliRunner().invoke(cli, ["gpu", "roofline", "--twin", "h200-sxm", *extra])
        assert mixed.exit_code == 2 and f"so {extra[0]} (the hardware" in mixed.output


#: A roofline measured on a lent H200 (observe-only, stock setting, driver 580.159.04, torch
#: 2.11): real noise, GEMMs held below 1980 MHz by the 700 W limit, the idle read at 345 MHz.
MEASURED_H200 = Path(__file__).parent / "data" / "h200-roofline.nc"


def test_a_roofline_measured_on_an_h200_fits_a_twin_that_reproduces_it(tmp_path: Path) -> None:
    import tomllib

    out = tmp_path / "h200-fit.toml"
    result = CliRunner().invoke(cli, ["twin", "fit", str(MEASURED_H200), "-o", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    residuals = tomllib.loads(out.read_text())["fit"]["residuals"]
    ds = store.read(MEASURED_H200)
    # the power limit held the big GEMMs below 1980 MHz: fitted at the clocks they ran at,
    # the twin's peak, bandwidth and ridge are the measured ones
    gemm = ds["kind"] == "gemm"
    assert float(ds["observed_sm_clock_mhz"].where(gemm).min()) < 1980
    assert "ran below the setting's clock" in result.output
    for name in ("peak_flop_s_rel_rms", "bandwidth_rel_rms", "ridge_rel_max"):
        assert residuals[name] < 1e-9, name
    # one power model for every kernel: within a tenth of what they drew
    assert residuals["power_rms_w"] < 0.1 * float(ds["power_w"].mean())
    # the idle power is the one read at the idle clock; the raised reading gives the rest
    assert ds.attrs["idle_sm_clock_mhz"] == profile.idle_sm_clock_mhz
    assert profile.idle_power_w == ds.attrs["idle_power_w"]
    raised = traps.idle_power_w(profile, ds.attrs["raised_idle_sm_clock_mhz"])
    assert raised == pytest.approx(ds.attrs["raised_idle_power_w"], rel=1e-9)
    # measured before the temperatures were recorded: its powers hold the leakage
    assert profile.leakage_w_per_c == 0.0 and "records no temperatures" in result.output


def test_a_fit_on_another_gpus_base_profile_says_so(tmp_path: Path) -> None:
    """`--base` of another GPU model than the roofline's (allowed: it is how a GPU the twin
    has no profile for is fitted) is named in a note, not fitted against silently; the
    measured GPU's own profile (the default) draws none."""
    out = tmp_path / "p.toml"
    args = ["twin", "fit", str(MEASURED_H200), "-o", str(out)]
    other = CliRunner().invoke(cli, [*args, "--base", "h100-sxm"])
    assert other.exit_code == 0, other.output
    said = " ".join(other.output.split())
    assert (
        "was measured on NVIDIA H200, the base profile h100-sxm is the twin's NVIDIA H100" in said
    )
    own = CliRunner().invoke(cli, args)
    assert own.exit_code == 0 and "the base profile" not in own.output, own.output
    # an H20 is no H200, whose name merely begins as its does (whole words, as the profiles
    # are matched): fitted on the H200's base, it is said, as any other GPU's would be
    h20 = store.read(MEASURED_H200).load()
    h20.attrs.update(gpu_name="NVIDIA H20", device_name="NVIDIA H20")
    store.write(h20, tmp_path / "h20.nc")
    result = CliRunner().invoke(
        cli, ["twin", "fit", str(tmp_path / "h20.nc"), "-o", str(out), "--base", "h200-sxm"]
    )
    assert result.exit_code == 0, result.output
    assert "measured on NVIDIA H20, the base profile h200-sxm" in " ".join(result.output.split())


def test_a_gpu_faster_than_its_base_raises_the_bases_peaks_not_an_efficiency_above_1(
    tmp_path: Path,
) -> None:
    """GEMMs and bandwidth kernels faster than the base's peaks (a faster GPU fitted on a
    slower one's base) gave efficiencies above 1, a profile `twin predict` refuses: the fit
    raises the base's FLOP/s per clock per SM and HBM bandwidth instead, says so, and keeps the
    measured FLOP/s, bandwidth and ridge."""
    truth = dataclasses.replace(
        true_profile(gemm_efficiency=0.9, hbm_efficiency=0.95),
        flop_per_clk_per_sm=2 * H100.flop_per_clk_per_sm,
        hbm_bandwidth_gb_s=1.5 * H100.hbm_bandwidth_gb_s,
    )
    ds = twin_roofline(truth)
    fit = fit_roofline(ds, H100)
    p = fit.profile
    assert 0 < p.gemm_efficiency <= 1 and 0 < p.hbm_efficiency <= 1
    assert p.flop_per_clk_per_sm > H100.flop_per_clk_per_sm
    assert p.hbm_bandwidth_gb_s > H100.hbm_bandwidth_gb_s
    assert {"flop_per_clk_per_sm", "hbm_bandwidth_gb_s"} <= set(fit.fitted)
    said = " ".join(fit.notes)
    assert "flop_per_clk_per_sm is raised from" in said
    assert "hbm_bandwidth_gb_s is raised from" in said
    for f, measured in zip(CLOCKS, ds["ridge_point"].values, strict=True):
        assert p.peak_flops(f) == pytest.approx(truth.peak_flops(f), rel=0.01)
        assert physics.bandwidth_bytes_s(p, f) == pytest.approx(
            physics.bandwidth_bytes_s(truth, f), rel=0.01
        )
        assert achievable_ridge_point(p, f) == pytest.approx(measured, rel=0.005)
    path = tmp_path / "fast.toml"
    path.write_text(profile_toml(fit))
    loaded = load_profile(path)  # what `twin predict` reads, and refuses an efficiency in
    assert loaded.hbm_bandwidth_gb_s == p.hbm_bandwidth_gb_s
    assert loaded.flop_per_clk_per_sm == p.flop_per_clk_per_sm


def _one_setting(campaign: str) -> str:
    """SMALL_CAMPAIGN's text cut to one clock, power limit, batch, corpus and repeat: a predict
    that only has to run."""
    for a, b in (
        ("sm_clock = [1980, 1500, 1005]", "sm_clock = [1980]"),
        ("power_limit = [700, 300]", "power_limit = [700]"),
        ("batch = [1, 8]", "batch = [1]"),
        ('corpora = ["code", "conversation"]', 'corpora = ["code"]'),
        ("repeats = 2", "repeats = 1"),
    ):
        assert a in campaign
        campaign = campaign.replace(a, b)
    return campaign


def test_a_profile_fit_writes_on_another_gpus_base_is_one_predict_takes(
    small_campaign: Path, tmp_path: Path
) -> None:
    """The measured H200 fitted on the H100's base: its bandwidth outruns the H100's, and the
    profile `fit` wrote (hbm_efficiency 1.31) was refused by `predict` (exit 2). A tool does
    not write a file it refuses: the fit raises the bandwidth and predict sweeps on it."""
    out = tmp_path / "p.toml"
    fitted = CliRunner().invoke(
        cli, ["twin", "fit", str(MEASURED_H200), "-o", str(out), "--base", "h100-sxm"]
    )
    assert fitted.exit_code == 0, fitted.output
    short = _one_setting(small_campaign.read_text())
    (tmp_path / "c.toml").write_text(short)
    args = ["twin", "predict", str(tmp_path / "c.toml"), "--profile", str(out)]
    result = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "o"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert open_cube(tmp_path / "o" / "cube.nc").attrs["twin_profile"] == "h100-sxm-fit:none"
    assert "hbm_bandwidth_gb_s is raised from" in " ".join(fitted.output.split())


@pytest.mark.parametrize(
    "name", ["h100-sxm:none", "my:fit", 'my"fit', "my\\fit", "my\x7ffit", "h100-sxm", "  "]
)
def test_a_fit_name_no_campaign_can_name_as_that_fit_is_refused_before_the_fit(
    tmp_path: Path, name: str
) -> None:
    """A fit's name is the key a campaign's `gpu.profile` names: `h100-sxm:none` reads as the
    shipped H100 with its traps off (predict swept that H100, the fit's figures unused),
    `my:fit` as an unknown profile `my` with traps `fit`, a quote, backslash or DEL wrote a
    table header TOML cannot read, and a shipped key or a blank one is refused by predict: each is
    one line at the fit, before anything is written."""
    source = store.write(twin_roofline(true_profile()), tmp_path / "roofline.nc")
    out = tmp_path / "p.toml"
    result = CliRunner().invoke(cli, ["twin", "fit", str(source), "-o", str(out), "--name", name])
    assert result.exit_code == 2, result.output
    assert "--name" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


# the last two as TOML escapes in the table's header: a newline and DEL in the name, which
# `twin fit --name` refuses, went into the cube's twin_profile and every line that names it
@pytest.mark.parametrize(
    "name", ["h100-sxm:none", "h200-sxm:-leakage", "my:fit", "", "my\\nfit", "my\\u007ffit"]
)
def test_predict_refuses_a_profile_whose_name_a_campaign_reads_as_another(
    small_campaign: Path, tmp_path: Path, name: str
) -> None:
    """A profile file (hand-edited, or written before `twin fit` checked `--name`) whose table
    is named as a shipped profile with a trap list was swept as that shipped profile, its own
    figures silently unused; an empty name let the campaign's own `gpu.profile` run. Refused in
    one line before the sweep begins."""
    fit = fit_roofline(twin_roofline(true_profile()), H100, key="my-h100")
    text = profile_toml(fit)
    assert '[gpu."my-h100"]' in text
    path = tmp_path / "p.toml"
    path.write_text(text.replace('[gpu."my-h100"]', f'[gpu."{name}"]'))
    out = tmp_path / "o"
    args = ["twin", "predict", str(small_campaign), "--profile", str(path), "-o", str(out)]
    result = CliRunner().invoke(cli, [*args, "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "dvfs twin fit --name" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_the_readmes_figures_of_the_measured_h200_are_the_files() -> None:
    """README's known limits quote the lent H200's roofline: each figure is read back from
    `tests/data/h200-roofline.nc` (the GEMVs' range was the up-projection's alone, 496-505 W,
    where the down-projection's drew 472 W)."""
    ds = store.read(MEASURED_H200).isel(setting=0)
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    kind = ds["kind"]
    gemv = ds["power_w"].where(kind == "gemv", drop=True)
    assert f"GEMVs drew {float(gemv.min()):.0f}-{float(gemv.max()):.0f} W there" in readme
    triad = ds.sel(kernel="triad")
    assert f"the triad {float(triad['power_w']):.0f} W" in readme
    assert f"the triad moved {float(triad['bytes'] / triad['seconds']) / 1e12:.2f} TB/s" in readme
    held = ds["observed_sm_clock_mhz"].where((kind == "gemm") & (ds["m"] >= 128), drop=True)
    assert f"held the large GEMMs at {float(held.min()):.0f}-{float(held.max()):.0f} MHz" in readme
    peak = float((ds["flops"] / ds["seconds"]).where(kind == "gemm").max()) / 1e12
    assert f"so the peak was {peak:.0f} TFLOP/s" in readme
    assert f"so the ridge is {float(ds['ridge_point']):.0f} FLOP/B" in readme


def test_predict_checks_the_campaigns_knobs_against_the_profile_it_predicts_on(
    small_campaign: Path, tmp_path: Path
) -> None:
    """The campaign's clocks and power limits were checked against its own `gpu.profile` only:
    one the fitted profile does not support (a fit keeps its base's clocks, an H200's start at
    345 MHz) failed at the first lock (exit 1) or setting; now refused in one line
    naming the profile, before anything is written (exit 2, as a campaign's own twin
    refuses it)."""
    fit = fit_roofline(twin_roofline(true_profile()), H100, key="my-h100")
    text = profile_toml(fit)
    low = min(c for c in H100.supported_sm_clocks_mhz() if c >= 1000)
    campaign = small_campaign.read_text()
    assert "sm_clock = [1980, 1500, 1005]" in campaign and "power_limit = [700, 300]" in campaign
    out = tmp_path / "o"
    for field, value, edit in (
        ("min_sm_clock_mhz", 1020, ("sm_clock = [1980, 1500, 1005]", f"sm_clock = [1980, {low}]")),
        ("power_limit_min_w", 350.0, ("power_limit = [700, 300]", "power_limit = [700, 300]")),
    ):
        assert f"\n{field} = " in text
        lines = [
            f"{field} = {value}" if line.startswith(f"{field} = ") else line
            for line in text.splitlines()
        ]
        path = tmp_path / "p.toml"
        path.write_text("\n".join(lines) + "\n")
        assert getattr(load_profile(path), field) == value
        (tmp_path / "c.toml").write_text(campaign.replace(*edit))
        args = ["twin", "predict", str(tmp_path / "c.toml"), "--profile", str(path), "-o", str(out)]
        result = CliRunner().invoke(cli, [*args, "--no-progress"])
        assert result.exit_code == 2, result.output
        assert "my-h100" in result.output and str(path) in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_predict_keeps_the_trap_list_the_campaigns_gpu_profile_names(
    small_campaign: Path, tmp_path: Path
) -> None:
    """A campaign on `h100-sxm:none` asks for the twin without NVML's traps: predicted on a
    fitted profile (whose traps are its base's, on), the trap list was dropped and the cells
    measured through the 100-ms energy counter and the other traps all the same."""
    fit = fit_roofline(twin_roofline(true_profile()), H100, key="my-h100")
    assert traps.active(fit.profile)  # the base's traps, on
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(fit))
    campaign = small_campaign.read_text()
    assert 'profile = "h100-sxm:none"' in campaign
    short = _one_setting(campaign)
    for traps_named in (":none", ":-settle", ""):
        (tmp_path / "c.toml").write_text(
            short.replace('profile = "h100-sxm:none"', f'profile = "h100-sxm{traps_named}"')
        )
        out = tmp_path / f"o{traps_named}"
        args = ["twin", "predict", str(tmp_path / "c.toml"), "--profile", str(path), "-o", str(out)]
        result = CliRunner().invoke(cli, [*args, "--no-progress"])
        assert result.exit_code == 0, result.output
        ds = open_cube(out / "cube.nc")
        assert ds.attrs["twin_profile"] == f"my-h100{traps_named}"


def test_predict_refuses_a_figure_far_beyond_any_gpu_in_one_line(
    small_campaign: Path, tmp_path: Path
) -> None:
    """A hand-edited profile's figure a thousand times the twin's own GPUs' is no GPU (a typo,
    a unit slip): refused in one line before anything runs (exit 2). A settle time or an energy
    counter period of 1e300 s was an internal error (an int of infinity), a bandwidth knee of
    1e300 MHz another (run_load never advanced the clock), and a host overhead of 1e6 s ran
    the prediction out of memory. A figure at the bound still loads."""
    fit = fit_roofline(twin_roofline(true_profile()), H100, key="my-h100")
    text = profile_toml(fit)
    out = tmp_path / "o"
    path = tmp_path / "p.toml"

    def edited(field: str, value: object) -> str:
        assert f"\n{field} = " in text
        return "\n".join(
            f"{field} = {value}" if line.startswith(f"{field} = ") else line
            for line in text.splitlines()
        )

    for field, value in (
        ("settle_time_s", 1e300),
        ("energy_counter_period_s", 1e300),
        ("bandwidth_knee_mhz", 1e300),
        ("host_overhead_s", 1e6),
        ("gemm_tile_tokens", 10**15),
    ):
        path.write_text(edited(field, value) + "\n")
        args = ["twin", "predict", str(small_campaign), "--profile", str(path), "-o", str(out)]
        result = CliRunner().invoke(cli, [*args, "--no-progress"])
        assert result.exit_code == 2, (field, result.output)
        assert result.output.strip().splitlines() == [
            f"Error: {path} [gpu.my-h100]: {field} = {value!r} is over 1000 times the twin's "
            f"own GPUs' ({getattr(H100, field):g}), beyond any GPU: write the profile again "
            "with `dvfs twin fit`"
        ], field
        assert not out.exists()
    path.write_text(edited("settle_time_s", 1000 * H100.settle_time_s) + "\n")
    assert load_profile(path).settle_time_s == 1000 * H100.settle_time_s
