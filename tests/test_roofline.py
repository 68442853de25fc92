"""`dvfs gpu roofline` on the CPU path (a CPU build of torch), and its clock stepping through
the sweep's safety layer against the fake NVML: restored on exit, on SIGTERM, and after SIGKILL
by `dvfs gpu reset`; observe-only calls no setter. torch is imported once per test process,
by the first of these tests it runs (not at collection: a worker running none never imports it)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import made_once
from nvml_support import load_fake, root_fake_env

from dvfs.cli import cli


@pytest.fixture(scope="module", autouse=True)
def _torch() -> None:
    pytest.importorskip("torch")


#: Tiny sizes: the whole CPU roofline takes well under a second of kernel time.
TINY = [
    "--device", "cpu", "--hidden", "64", "--intermediate", "256", "--tokens", "1,256",
    "--bandwidth-mib", "1", "--min-time", "0.02", "--settle", "0",
]  # fmt: skip
SETTERS = (
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetPowerManagementLimit_v2",
)


def invoke(*args: str) -> object:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One CPU roofline, as JSON and as a file (shared by the read-only tests): run once per
    session (`made_once`: the xdist workers share it)."""

    def make(folder: Path) -> None:
        result = invoke("gpu", "roofline", *TINY, "--json", "-o", str(folder / "roofline.nc"))
        (folder / "roofline.json").write_text(result.stdout)

    folder = made_once(tmp_path_factory, "roofline-cpu-run", make)
    return json.loads((folder / "roofline.json").read_text()), folder / "roofline.nc"


def test_cpu_run_measures_rates_and_the_ridge(cpu_run) -> None:
    doc, _ = cpu_run
    assert doc["schema"] == "dvfs.roofline/1" and doc["device"] == "cpu"
    [stock] = doc["settings"]
    assert stock["setting"] == "stock" and stock["peak_flop_s"] > 0
    assert stock["bandwidth_bytes_s"] > 0
    assert stock["ridge_point"] == pytest.approx(stock["peak_flop_s"] / stock["bandwidth_bytes_s"])
    kernels = {k["kernel"]: k for k in stock["kernels"]}
    assert set(kernels) >= {"gemm-up-m1", "gemm-down-m256", "gemv-up", "triad", "copy"}
    assert all(k["flop_s"] >= 0 and k["bytes_s"] > 0 for k in kernels.values())
    best_gemm = max(k["flop_s"] for k in kernels.values() if k["kind"] == "gemm")
    assert stock["peak_flop_s"] == pytest.approx(best_gemm)


def test_gemm_efficiency_depends_on_the_token_count(cpu_run) -> None:
    doc, _ = cpu_run
    kernels = {k["kernel"]: k for k in doc["settings"][0]["kernels"]}
    for shape in ("up", "down"):
        one, many = kernels[f"gemm-{shape}-m1"], kernels[f"gemm-{shape}-m256"]
        # One token per weight read is memory-bound; 256 tokens reuse each weight 256 times.
        assert one["gemm_efficiency"] < many["gemm_efficiency"] <= 1.0
    assert max(k["gemm_efficiency"] or 0 for k in kernels.values()) == pytest.approx(1.0)
    assert kernels["triad"]["gemm_efficiency"] is None


def test_cpu_energy_is_nan_and_said_so(cpu_run) -> None:
    doc, _ = cpu_run
    [stock] = doc["settings"]
    assert stock["j_per_flop"] is None and stock["j_per_byte"] is None  # NaN in JSON
    assert all(k["power_w"] is None for k in stock["kernels"])
    assert any("energy: not measured (NaN)" in n and "CPU" in n for n in doc["notes"])
    text = invoke("gpu", "roofline", *TINY)
    assert "energy: not measured (NaN)" in text.stdout and "Per setting" in text.stdout


def test_the_file_reads_back_with_the_same_roofline(cpu_run) -> None:
    from dvfs.roofline import store

    doc, path = cpu_run
    ds = store.read(path)
    assert float(ds["ridge_point"].sel(setting="stock")) == pytest.approx(
        doc["settings"][0]["ridge_point"]
    )
    assert math.isnan(float(ds["j_per_flop"].sel(setting="stock")))


def test_twin_fit_of_the_cpu_roofline_matches_its_ridge(cpu_run, tmp_path: Path) -> None:
    from dvfs.twin.fit import achievable_ridge_point, load_profile

    doc, path = cpu_run
    out = tmp_path / "fitted.toml"
    result = invoke("twin", "fit", str(path), "-o", str(out), "--base", "h100-sxm")
    assert "no SM clock recorded" in result.output
    profile = load_profile(out)
    ridge = achievable_ridge_point(profile, profile.max_sm_clock_mhz)
    # the large-M ridge: at or above the best GEMM's (its tiles, waves and memory time's share
    # taken off), which the fit reproduces
    assert ridge >= doc["settings"][0]["ridge_point"]
    assert tomllib.loads(out.read_text())["fit"]["residuals"]["ridge_rel_max"] < 1e-9


def test_without_torch_one_line_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    result = CliRunner().invoke(cli, ["gpu", "roofline", "--device", "cpu"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "pip install 'dvfs[torch]'" in lines[0], result.output


def test_dvfs_and_its_help_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from dvfs.cli import cli\n"
        "import dvfs.roofline.run, dvfs.roofline.store, dvfs.twin.fit, dvfs.cli.gpu\n"
        "assert CliRunner().invoke(cli, ['gpu', 'roofline', '--help']).exit_code == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_usage_errors_are_one_line() -> None:
    cases = [
        (["--clocks", "1500"], "--clocks needs a GPU"),
        (["--device", "tpu"], "use cuda, cuda:N or cpu"),
        (["--tokens", "1,x"], "comma-separated list of integers"),
    ]
    for extra, message in cases:
        result = CliRunner().invoke(cli, ["gpu", "roofline", *TINY, *extra])
        assert result.exit_code == 2, result.output
        assert message in result.output


@pytest.mark.parametrize(
    ("command", "option", "first", "second"),
    [
        (["gpu", "roofline", "--twin", "h100-sxm"], "--clocks", 1500, 1200),
        (["gpu", "roofline", "--twin", "h100-sxm"], "--tokens", 64, 16),
        (["gpu", "settle", "--twin", "h100-sxm"], "--clocks", 1500, 1200),
        (["gpu", "settle", "--twin", "h100-sxm", "--load"], "--power-limits", 500, 400),
    ],
)
def test_a_value_listed_twice_is_refused(
    command: list[str], option: str, first: int, second: int
) -> None:
    """`--clocks 1500,1200,1500` (values each command accepts once): the repeat was dropped
    without a word (one setting fewer measured than listed); it is refused in one line naming
    the option and the value, as a campaign's sm_clock and power_limit lists refuse theirs,
    before anything runs."""
    listed = f"{first},{second},{first}"
    result = CliRunner().invoke(cli, [*command, option, listed])
    assert result.exit_code == 2, result.output
    error = " ".join(result.stderr.split())
    assert f"Invalid value for '{option}': '{listed}' lists {first} twice" in error, error


@pytest.mark.parametrize(
    ("command", "option", "listed"),
    [
        (["gpu", "roofline", "--twin", "h100-sxm"], "--clocks", "1500,,1200"),
        (["gpu", "roofline", "--twin", "h100-sxm"], "--tokens", "64,16,"),
        (["gpu", "settle", "--twin", "h100-sxm"], "--clocks", ",1500"),
        (["gpu", "settle", "--twin", "h100-sxm", "--load"], "--power-limits", "500, ,400"),
        (["gpu", "roofline", "--twin", "h100-sxm"], "--clocks", ""),
        (["gpu", "settle", "--twin", "h100-sxm"], "--clocks", " "),
    ],
)
def test_an_empty_entry_in_a_list_is_refused(command: list[str], option: str, listed: str) -> None:
    """`--clocks 1500,,1200` (a value left out, or a stray comma) was read as `1500,1200`, and
    `--clocks ''` (an unset shell variable) as no option at all, and measured without a word;
    each is refused in one line, as `sweep --gpus 0,,1` and `--gpus ''` are, before anything
    runs."""
    result = CliRunner().invoke(cli, [*command, option, listed])
    assert result.exit_code == 2, result.output
    error = " ".join(result.stderr.split())
    said = f"'{listed}': an empty entry" if listed.strip() else "it is empty"
    assert f"Invalid value for '{option}': {said}" in error, error


def test_cuda_without_a_cuda_device_names_the_cpu_path() -> None:
    result = CliRunner().invoke(cli, ["gpu", "roofline", "--device", "cuda", "--gpu", "0"])
    assert result.exit_code == 2 and "--device cpu" in result.output, result.output


def test_cuda_without_a_cuda_device_names_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a CUDA device the line named only --device cpu (tiny CPU tensors, no energy),
    not --twin, which simulates the GPU's roofline with no torch and no GPU: it names both, and
    the twin's command it gives runs."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(cli, ["gpu", "roofline"])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "--twin h100-sxm" in said and "--device cpu" in said, said
    twin = CliRunner().invoke(cli, ["gpu", "roofline", "--twin", "h100-sxm", "--json"])
    assert twin.exit_code == 0, twin.output


# -- stepping clocks through the fake NVML ---------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return root_fake_env(tmp_path, monkeypatch)


@pytest.fixture
def nvml(env, monkeypatch: pytest.MonkeyPatch):
    module = load_fake()
    module.fake_reset_state()
    module.fake_update_device(0, power_limit_mw=650_000)  # not the default: restore what was
    monkeypatch.setitem(sys.modules, "pynvml", module)  # the CLI's `import pynvml` finds it
    return module


def setter_calls(nvml) -> list[dict]:
    return [c for c in nvml.fake_calls() if c["fn"] in SETTERS]


def assert_as_found(nvml, state_dir: Path) -> None:
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None
    assert device["power_limit_mw"] == 650_000
    assert not list(state_dir.glob("GPU-*.json")), "state file left behind"


def test_clocks_are_stepped_and_restored(nvml, tmp_path: Path) -> None:
    result = invoke("gpu", "roofline", *TINY, "--gpu", "0", "--clocks", "1500,1200", "--json")
    doc = json.loads(result.stdout)
    assert [s["setting"] for s in doc["settings"]] == ["stock", "1500", "1200"]
    assert [s["sm_clock_mhz"] for s in doc["settings"]][1:] == [1500, 1200]
    assert [s["locked"] for s in doc["settings"]] == [False, True, True]
    assert doc["gpu_name"] == "NVIDIA H100 80GB HBM3"
    locks = [c["args"] for c in setter_calls(nvml) if c["fn"] == "nvmlDeviceSetGpuLockedClocks"]
    assert locks == [[1500, 1500], [1200, 1200]]
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_unsupported_clock_is_refused_before_any_change(nvml, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["gpu", "roofline", *TINY, "--gpu", "0", "--clocks", "1501"])
    assert result.exit_code == 2 and "1501 MHz is not a supported SM clock" in result.output
    assert setter_calls(nvml) == []


def test_observe_only_calls_no_setter(nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")  # a user without root can observe
    result = invoke("gpu", "roofline", *TINY, "--gpu", "0", "--observe-only", "--json")
    doc = json.loads(result.stdout)
    assert [s["setting"] for s in doc["settings"]] == ["stock"]
    assert doc["observe_only"] == 1 and any("observe-only" in n for n in doc["notes"])
    assert setter_calls(nvml) == []
    refused = CliRunner().invoke(
        cli, ["gpu", "roofline", *TINY, "--gpu", "0", "--observe-only", "--clocks", "1500"]
    )
    assert refused.exit_code == 2 and "stock setting only" in refused.output


def test_observe_only_without_root_refuses_a_gpu_roots_dvfs_holds(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's `gpu roofline --observe-only` took GPU 0's lock in the user's own state folder
    and measured it while root's sweep held it in /var/lib/dvfs (stepping its clocks): its
    'stock' rates were root's settings. It now refuses it, naming root's holder."""
    import os

    from dvfs.backends import open_gpus
    from dvfs.gpu import safety

    root = tmp_path / "dvfs-state"
    monkeypatch.setattr(safety, "ROOT_STATE_DIR", root)
    with open_gpus([0]) as gpus, safety.GpuLocks(root).hold(gpus):  # as root's sweep does
        monkeypatch.delenv("DVFS_STATE_DIR")
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "user-state"))
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
        result = CliRunner().invoke(cli, ["gpu", "roofline", *TINY, "--gpu", "0", "--observe-only"])
    said = " ".join(result.output.split())
    assert result.exit_code == 3, result.output
    assert f"in use by another dvfs process (pid {os.getpid()})" in said, said
    assert f"its lock is in {root}" in said, said


def test_without_root_the_message_names_observe_only(nvml, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    result = CliRunner().invoke(cli, ["gpu", "roofline", *TINY, "--gpu", "0", "--clocks", "1500"])
    assert result.exit_code == 4, result.output
    assert "permission denied" in result.output and "roofline --observe-only" in result.output
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_energy_window_spans_counter_updates(nvml) -> None:
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.roofline.run import energy_window

    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        window = energy_window(gpu, lambda: time.sleep(0.002), lambda: None, 0.2, sync_every=5)
        idle_c = gpu.temperature_c()
    # the die's temperature is read with the clock (the twin fit takes its leakage off)
    assert window.temperature_c == idle_c
    assert window.seconds >= 0.2
    # The fake's idle board draws 75 W at 345 MHz; its counter moves on a 20 ms grid.
    assert window.power_w == pytest.approx(75.0, rel=0.1)
    assert window.sm_clock_mhz == 345


def test_a_counter_that_never_moves_gives_nan_not_zero() -> None:
    from dvfs.roofline.run import energy_window

    class Stuck:
        def energy_mj(self) -> int:
            return 1000

        def sm_clock_mhz(self) -> int:
            return 1980

        def temperature_c(self) -> int:
            return 60

    now = iter(range(1000))
    window = energy_window(Stuck(), lambda: None, lambda: None, 3, clock=lambda: next(now))
    assert math.isnan(window.power_w) and window.sm_clock_mhz == 1980


def test_a_counter_reset_in_the_window_gives_nan_not_a_negative_power() -> None:
    """A driver reload or GPU reset restarts the counter from zero mid-window: the difference
    across it is no energy (it read -200,000 W here)."""
    from dvfs.roofline.run import energy_window

    now = iter(range(1000))
    reads = iter(range(1000))

    class Reset:
        def energy_mj(self) -> int:
            n = next(reads)
            return 10**9 + 100 * n if n < 3 else 100 * n  # reset after the third read

        def sm_clock_mhz(self) -> int:
            return 1980

        def temperature_c(self) -> int:
            return 60

    window = energy_window(Reset(), lambda: None, lambda: None, 3, clock=lambda: next(now))
    assert math.isnan(window.power_w) and window.sm_clock_mhz == 1980


def _start(env: dict[str, str], tmp_path: Path) -> subprocess.Popen:
    # TINY's short kernels (the stock setting, run before the first lock, costs little) over
    # 87 clocks: some 14 s of kernels after the first lock, long enough to be interrupted.
    clocks = ",".join(str(c) for c in range(1500, 209, -15))
    return subprocess.Popen(
        [sys.executable, "-m", "dvfs", "gpu", "roofline", *TINY]
        + ["--gpu", "0", "--clocks", clocks, "-o", str(tmp_path / "r.nc")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_until_locked(nvml, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while nvml.fake_device_state(0)["locked_clocks"] is None:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the roofline never locked a clock"
        time.sleep(0.02)


def _dvfs(*args: str) -> subprocess.CompletedProcess:
    """`dvfs ARGS` after the kill, in this process (the `nvml` fixture's fake, the `env`
    fixture's environment): no second interpreter, no second import of torch."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.mark.slow
def test_sigterm_restores(nvml, env, tmp_path: Path) -> None:
    proc = _start(env, tmp_path)
    try:
        _wait_until_locked(nvml, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output
    assert "GPU settings restored" in output and "Traceback" not in output
    assert_as_found(nvml, tmp_path / "dvfs-state")


@pytest.mark.slow
def test_sigkill_then_gpu_reset_restores(nvml, env, tmp_path: Path) -> None:
    state_dir = tmp_path / "dvfs-state"
    proc = _start(env, tmp_path)
    try:
        _wait_until_locked(nvml, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert nvml.fake_device_state(0)["locked_clocks"] is not None  # the GPU kept the change
    [state_file] = state_dir.glob("GPU-*.json")
    recorded = json.loads(state_file.read_text())
    assert recorded["original"]["power_limit_mw"] == 650_000
    assert recorded["command"] == "gpu roofline"
    refused = _dvfs("gpu", "roofline", *TINY, "--gpu", "0", "--clocks", "1500")
    assert refused.returncode == 3 and "dvfs gpu reset" in refused.stderr, refused.stderr
    reset = _dvfs("gpu", "reset")
    assert reset.returncode == 0 and "restored GPU 0" in reset.stdout, reset.stderr
    assert_as_found(nvml, state_dir)


# -- the measured ridge in the roofline analysis ---------------------------------------------


def _measured(clocks: list[float], ridges: list[float]):
    import xarray as xr

    return xr.Dataset(
        {"sm_clock_mhz": ("setting", clocks), "ridge_point": ("setting", ridges)},
        attrs={"gpu_name": "NVIDIA H100 80GB HBM3"},
    )


def test_measured_ridge_interpolates_and_scales_outside() -> None:
    from dvfs.analysis.roofline import measured_ridge

    got = measured_ridge(_measured([1980, 990], [300, 160]), np.array([495, 990, 1485, 1980, 2100]))
    np.testing.assert_allclose(got, [80, 160, 230, 300, 300 * 2100 / 1980])


def test_compare_uses_the_measured_ridge(small_sweep: Path, tmp_path: Path) -> None:
    from dvfs.analysis.roofline import roofline
    from dvfs.cube import open_analysable

    cube = open_analysable(small_sweep)
    clocks = cube["sm_clock"].values.astype(float)
    measured = _measured([float(clocks.max())], [42.0])
    roof = roofline(cube, measured=measured)
    np.testing.assert_allclose(roof["ridge_point"].values, 42.0 * clocks / clocks.max())
    assert roof.attrs["ridge"] == "measured (NVIDIA H100 80GB HBM3)"
    assert roofline(cube).attrs["ridge"].startswith("twin physics")


def test_a_roofline_file_that_cannot_be_read_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A roofline file this user may not read was called no readable netCDF file, as if it
    were damaged: it is said to be unreadable, with the system's reason. (Root reads any
    file, so the refusal is the operating system's, simulated.)"""
    from dvfs.roofline import store

    path = tmp_path / "r.nc"
    path.write_bytes(b"CDF\x01" + bytes(60))
    opened = Path.open

    def refused(self: Path, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return opened(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", refused)
    with pytest.raises(
        store.RooflineFileError, match=r"r\.nc cannot be read \(Permission denied\)"
    ):
        store.read(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["gpu", "settle", "--twin", "h100-sxm", "--gpu", "0", "--gpu", "0"],
        ["gpu", "info", "--twin", "h100-sxm", "0", "0"],
    ],
)
def test_a_twin_gpu_named_twice_is_refused(argv: list[str]) -> None:
    """`--gpu 0 --gpu 0` on the twin opened two twins both called GPU 0 and measured both
    (NVML's GPUs refuse it): it is the same one-line usage error."""
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "Error: GPU 0 is named twice: name each GPU once"
    ], result.output


def test_an_interrupted_observe_only_run_says_nothing_of_settings_it_never_changed(
    nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in `gpu roofline --observe-only`: exit 130 with no "GPU settings restored." line,
    which told of a restore of settings the run never changed."""
    import dvfs.roofline.run as roofline_run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    monkeypatch.setattr(roofline_run, "_measure", interrupted)
    result = CliRunner().invoke(cli, ["gpu", "roofline", *TINY, "--gpu", "0", "--observe-only"])
    assert result.exit_code == 130, result.output
    assert "GPU settings" not in result.output, result.output
    assert setter_calls(nvml) == []
