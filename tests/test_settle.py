"""Settle time measured, not assumed: `dvfs.measure.settle` against scripted GPUs on virtual
time (a known settle, overshoot and delay), the detector's maths as properties, and
`dvfs gpu settle` through the fake NVML (restored on exit and on SIGTERM, refused without
root or with --observe-only) and on the twin."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import default_dispositions
from hypothesis import given, settings
from hypothesis import strategies as st
from nvml_support import load_fake, root_fake_env

from dvfs.cli import cli
from dvfs.clock import VirtualClock
from dvfs.gpu.base import GpuIdentity, PowerLimitRange
from dvfs.gpu.knobs import KnobController, KnobSetting
from dvfs.measure.settle import measure_settle, settle_point

STOCK = KnobSetting(None, None)


class ScriptedGpu:
    """A GPU on a virtual clock whose observed SM clock follows a knob change `delay_s` late,
    overshoots by `overshoot_mhz` and holds the new value exactly from `settle_s` after the
    change; under `busy` its power follows the clock (and the power limit caps it)."""

    def __init__(
        self, clock: VirtualClock, *, settle_s: float, delay_s: float = 0.0, index: int = 0
    ) -> None:
        self.clock = clock
        self.settle_s = settle_s
        self.delay_s = delay_s
        self.busy = False
        self.wobble_mhz = 0  # until settled, swing this much every 50 ms
        self.lock: int | None = None
        self.limit_mw = 700_000
        self.idle_mhz = 345
        self._from = self._to = self.idle_mhz
        self._changed_ns = clock.now_ns()
        self._identity = GpuIdentity(
            index, f"GPU-scripted-{index}", "scripted", "0", "test", 0, 1980
        )
        self.writes: list[tuple[str, object]] = []

    @property
    def identity(self) -> GpuIdentity:
        return self._identity

    def _target(self) -> int:
        top = self.lock if self.lock is not None else (1980 if self.busy else self.idle_mhz)
        if self.busy:
            top = min(top, 345 + int((self.limit_mw / 1000 - 100) * 2.5))
        return top

    def _changed(self) -> None:
        self._from = self.sm_clock_mhz()
        self._to = self._target()
        self._changed_ns = self.clock.now_ns()

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        return tuple(range(1980, 209, -15))

    def power_limit_range(self) -> PowerLimitRange:
        return PowerLimitRange(200_000, 700_000, 700_000)

    def power_limit_mw(self) -> int:
        return self.limit_mw

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        self.writes.append(("lock", max_mhz))
        self.lock = max_mhz
        self._changed()

    def reset_sm_clock(self) -> None:
        self.writes.append(("reset", None))
        self.lock = None
        self._changed()

    def set_power_limit_mw(self, limit_mw: int) -> None:
        self.writes.append(("limit", limit_mw))
        self.limit_mw = limit_mw
        self._changed()

    def sm_clock_mhz(self) -> int:
        elapsed = (self.clock.now_ns() - self._changed_ns) / 1e9
        if elapsed < self.delay_s:
            return self._from
        if elapsed < self.settle_s:
            swing = self.wobble_mhz * (-1) ** int(elapsed / 0.05)
            return self._to + (40 if self._to >= self._from else -40) + swing  # overshoot
        return self._to

    def power_mw(self) -> int:
        return round((60 + (0.25 * self.sm_clock_mhz() if self.busy else 0)) * 1000)


def _load(clock: VirtualClock, gpus: list[ScriptedGpu], burst_s: float = 0.02):
    def load() -> None:
        for g in gpus:
            if not g.busy:
                g.busy = True
                g._changed()
        clock.sleep(burst_s)

    return load


@pytest.mark.parametrize("settle_s", [0.0, 0.013, 0.12, 0.8])
def test_measured_clock_settle_is_the_scripted_one_within_a_sample(settle_s: float) -> None:
    clock = VirtualClock()
    gpus = [ScriptedGpu(clock, settle_s=settle_s, delay_s=settle_s / 3)]
    period = 0.005
    with KnobController(gpus) as knobs:
        result = measure_settle(
            gpus, knobs, clock, before=STOCK, after=KnobSetting(1500, None), sample_period_s=period
        )
    assert result.observed, result.note
    assert settle_s <= result.clock_s <= settle_s + period + 1e-9
    assert result.power_s is None  # idle: nothing to see in power
    assert result.settle_s == pytest.approx(result.clock_s * 1.5 + period)
    assert result.clock_before_mhz == 345 and result.clock_after_mhz == 1500
    assert result.gpu_time_s >= result.clock_s + 0.5  # held for the hold time after it


class TwinResponseGpu(ScriptedGpu):
    """The twin's own settle model (`dvfs.twin.traps.settle_progress`: a second-order step
    response, within ~2% at the profile's settle time, exact from then) read as whole MHz."""

    def __init__(self, clock: VirtualClock, profile) -> None:
        super().__init__(clock, settle_s=profile.settle_time_s)
        self.profile = profile

    def sm_clock_mhz(self) -> int:
        from dvfs.twin.traps import settle_progress

        elapsed = (self.clock.now_ns() - self._changed_ns) / 1e9
        left = 1.0 - float(settle_progress(self.profile, np.array([elapsed]))[0])
        return round(self._to + (self._from - self._to) * left)


@pytest.mark.parametrize(("before", "after"), [(1980, 990), (990, 1980), (345, 1500)])
def test_the_twin_settle_model_is_measured_within_a_sample(before: int, after: int) -> None:
    from dvfs.twin.profiles import gpu_profile

    profile = gpu_profile("h100-sxm")
    assert profile.settle_time_s > 0 and profile.settle_overshoot > 0
    clock = VirtualClock()
    gpus = [TwinResponseGpu(clock, profile)]
    period = 0.005
    start = STOCK if before == 345 else KnobSetting(before, None)
    with KnobController(gpus) as knobs:
        result = measure_settle(
            gpus, knobs, clock, before=start, after=KnobSetting(after, None), sample_period_s=period
        )
    assert result.observed, result.note
    assert profile.settle_time_s <= result.clock_s <= profile.settle_time_s + period + 1e-9


@pytest.mark.parametrize("key", ["h100-sxm", "h200-sxm", "h100-sxm:-settle"])
def test_on_the_twin_the_measured_settle_is_its_simulated_one(key: str) -> None:
    """The twin with NVML's traps on: a lock shows over its profile's settle time (0 with the
    settle trap off), measured within one sample, idle and under a GEMM load."""
    from dvfs.backends import twin_gpus
    from dvfs.measure.loads import twin_gemm_load

    period = 0.005
    for load in (False, True):
        clock = VirtualClock()
        gpus = twin_gpus(key, [0, 1], clock)
        simulated = gpus[0].device.profile.settle_time_s
        with KnobController(gpus) as knobs:
            result = measure_settle(
                gpus,
                knobs,
                clock,
                before=KnobSetting(1980, None),
                after=KnobSetting(1200, None),
                sample_period_s=period,
                load=twin_gemm_load(gpus) if load else None,
            )
        assert result.observed, result.note
        assert simulated <= result.clock_s <= simulated + period + 1e-9, (load, result)
        if load:
            assert simulated <= result.power_s <= simulated + period + 1e-9
            assert result.power_after_w < result.power_before_w
        assert result.clock_after_mhz == 1200


def test_the_slowest_gpu_sets_the_settle() -> None:
    clock = VirtualClock()
    gpus = [ScriptedGpu(clock, settle_s=0.05), ScriptedGpu(clock, settle_s=0.3, index=1)]
    with KnobController(gpus) as knobs:
        result = measure_settle(gpus, knobs, clock, before=STOCK, after=KnobSetting(990, None))
    assert 0.3 <= result.clock_s <= 0.305


def test_a_delay_longer_than_the_hold_is_not_mistaken_for_no_change() -> None:
    """The clock stays at its old value for 0.7 s (longer than the 0.5 s hold): it must move
    before the change counts as shown."""
    clock = VirtualClock()
    gpus = [ScriptedGpu(clock, settle_s=0.9, delay_s=0.7)]
    with KnobController(gpus) as knobs:
        result = measure_settle(gpus, knobs, clock, before=STOCK, after=KnobSetting(1200, None))
    assert result.observed and 0.9 <= result.clock_s <= 0.905


def test_power_limit_settle_under_a_load() -> None:
    clock = VirtualClock()
    gpus = [ScriptedGpu(clock, settle_s=0.2, delay_s=0.1)]
    load = _load(clock, gpus)
    with KnobController(gpus) as knobs:
        result = measure_settle(
            gpus, knobs, clock, before=STOCK, after=KnobSetting(None, 300.0), load=load
        )
    assert result.observed, result.note
    # the power is within 5% once the clock leaves its old value; the clock's overshoot of
    # 40 MHz is outside its 15 MHz band until the end
    assert 0.1 <= result.power_s <= 0.105 and 0.2 <= result.clock_s <= 0.205
    assert result.settle_s == pytest.approx(result.clock_s * 1.5 + 0.005)
    assert result.power_after_w < result.power_before_w  # the cap pulled the power down
    assert result.clock_after_mhz == 345 + int(200 * 2.5)


def test_a_change_that_never_settles_times_out_with_a_note() -> None:
    clock = VirtualClock()
    gpus = [ScriptedGpu(clock, settle_s=60.0)]
    gpus[0].wobble_mhz = 100
    with KnobController(gpus) as knobs:
        result = measure_settle(
            gpus, knobs, clock, before=STOCK, after=KnobSetting(1200, None), timeout_s=2.0
        )
    assert not result.observed and result.clock_s is None
    assert result.settle_s == 2.0 and "did not hold" in result.note
    assert 2.0 <= result.gpu_time_s <= 2.0 + 0.6 + 0.5  # the hold before, the timeout after


def test_changes_that_cannot_show_are_not_timed_and_restore_follows() -> None:
    clock = VirtualClock()
    gpus = [ScriptedGpu(clock, settle_s=0.1)]
    with KnobController(gpus) as knobs:
        same = measure_settle(gpus, knobs, clock, before=STOCK, after=KnobSetting(None, 700.0))
        idle_limit = measure_settle(
            gpus, knobs, clock, before=STOCK, after=KnobSetting(None, 300.0)
        )
        assert gpus[0].writes == []  # neither applied anything
        for result, why in ((same, "nothing changes"), (idle_limit, "under a load")):
            assert not result.observed and why in result.note
            assert result.settle_s == 10.0 and result.gpu_time_s == 0.0
        measure_settle(gpus, knobs, clock, before=STOCK, after=KnobSetting(1200, None))
    assert gpus[0].lock is None and gpus[0].writes[-1] == ("reset", None)


# -- the detector ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(  # short series (drawing hundreds of floats per example is what costs): the edges matter
    settle=st.integers(0, 40),
    after=st.integers(4, 60),
    tol=st.floats(1.0, 50.0),
    data=st.data(),
)
def test_settle_point_finds_the_first_sample_of_the_last_steady_run(
    settle: int, after: int, tol: float, data: st.DataObject
) -> None:
    """Samples outside the band up to index `settle`, inside it after: the answer is that
    sample's time, whatever the noise inside the band and the excursions outside it."""
    period_ns = 5_000_000
    n = settle + after
    t = np.arange(1, n + 1, dtype=np.int64) * period_ns
    # each sample drawn once: outside the band (with a sign) before `settle`, inside after
    outside = data.draw(st.lists(st.floats(2.0, 40.0), min_size=settle, max_size=settle))
    signs = data.draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=settle, max_size=settle))
    inside = data.draw(st.lists(st.floats(-0.45, 0.45), min_size=after, max_size=after))
    x = np.empty(n)
    x[:settle] = 1000.0 + tol * np.asarray(outside) * np.asarray(signs)
    x[settle:] = 1000.0 + tol * np.asarray(inside)
    hold_s = after * period_ns / 1e9 / 2
    found = settle_point(t, x, since_ns=0, hold_s=hold_s, abs_tolerance=tol)
    assert found is not None
    assert found[0] == t[settle] / 1e9
    assert abs(found[1] - 1000.0) <= tol * 0.45 + 1e-9


def test_settle_point_waits_for_the_hold() -> None:
    t = np.arange(1, 101, dtype=np.int64) * 10_000_000  # 1 s of samples
    x = np.where(t < 600_000_000, 500.0, 1500.0)
    assert settle_point(t, x, since_ns=0, hold_s=0.5, abs_tolerance=15) is None
    found = settle_point(t, x, since_ns=0, hold_s=0.3, abs_tolerance=15)
    assert found == (0.6, 1500.0)


# -- `dvfs gpu settle` -----------------------------------------------------------------------

SETTERS = (
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetPowerManagementLimit_v2",
)
QUICK = ["--hold", "0.05", "--timeout", "5", "--sample-period", "0.005"]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return root_fake_env(tmp_path, monkeypatch)


@pytest.fixture
def nvml(env, monkeypatch: pytest.MonkeyPatch):
    module = load_fake()
    module.fake_reset_state()
    module.fake_update_device(0, power_limit_mw=650_000)  # not the default: restore what was
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def setter_calls(nvml) -> list[dict]:
    return [c for c in nvml.fake_calls() if c["fn"] in SETTERS]


def assert_as_found(nvml, state_dir: Path) -> None:
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None
    assert device["power_limit_mw"] == 650_000
    assert not list(state_dir.glob("GPU-*.json")), "state file left behind"


def test_cli_times_each_change_and_restores(nvml, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["gpu", "settle", "--gpu", "0", "--clocks", "1500,1200", *QUICK, "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "dvfs.settle/1" and doc["all_observed"]
    changes = [(c["before"], c["after"]) for c in doc["changes"]]
    assert changes == [("stock", "1500 MHz"), ("1500 MHz", "1200 MHz"), ("1200 MHz", "stock")]
    # the fake's clock follows a lock at once: seen at the first sample or two after it
    assert all(0 < c["clock_s"] <= 0.2 for c in doc["changes"])
    assert [c["clock_after_mhz"] for c in doc["changes"]] == [1500, 1200, 345]
    assert doc["settle_s"] == max(c["settle_s"] for c in doc["changes"])
    locks = [c["args"] for c in setter_calls(nvml) if c["fn"] == "nvmlDeviceSetGpuLockedClocks"]
    assert locks == [[1500, 1500], [1200, 1200]]
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_cli_table(nvml) -> None:
    result = CliRunner().invoke(cli, ["gpu", "settle", "--clocks", "1500", *QUICK])
    assert result.exit_code == 0, result.output
    assert "stock -> 1500 MHz" in result.output and "Settle to use:" in result.output


def test_observe_only_is_refused(nvml) -> None:
    result = CliRunner().invoke(cli, ["gpu", "settle", "--observe-only"])
    assert result.exit_code == 2 and "changing a knob" in result.output
    assert setter_calls(nvml) == []


def test_without_root_one_line_and_exit_4(nvml, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    result = CliRunner().invoke(cli, ["gpu", "settle", "--clocks", "1500", *QUICK])
    assert result.exit_code == 4, result.output
    assert "needs root" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_bad_settings_are_refused_before_any_change(nvml) -> None:
    for args, message in [
        (["--clocks", "1501"], "1501 MHz is not a supported SM clock"),
        (["--power-limits", "900", "--load", "--load-device", "cpu"], "outside the allowed"),
        (["--hold", "6", "--timeout", "5"], "must be shorter"),
        (["--power-limits", "300"], "only under a load: add --load"),
        (["--load", "--load-device", "tpu"], "use cuda or cpu"),
    ]:
        result = CliRunner().invoke(cli, ["gpu", "settle", *args])
        assert result.exit_code == 2 and message in result.output, result.output
    assert setter_calls(nvml) == []


def test_twin_power_limits_are_timed_under_a_load() -> None:
    result = CliRunner().invoke(
        cli, ["gpu", "settle", "--twin", "h100-sxm", "--power-limits", "300", "--load", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    first, back = doc["changes"]
    assert (first["before"], first["after"], back["after"]) == ("stock", "300 W", "stock")
    assert first["power_s"] is not None and first["power_after_w"] < first["power_before_w"]
    # the twin's 0.3 s settle, seen within a sample
    assert all(0.3 <= c["clock_s"] <= 0.305 for c in doc["changes"])
    assert doc["settle_s"] == pytest.approx(max(c["clock_s"] for c in doc["changes"]) * 1.5 + 0.005)
    assert doc["gpus"][0]["name"].endswith("(twin)")


def test_cli_under_a_torch_load_times_power_and_restores(nvml, tmp_path: Path) -> None:
    """The real-GPU load's path, with its GEMMs on the CPU beside the fake NVML GPU."""
    pytest.importorskip("torch")
    result = CliRunner().invoke(
        cli,
        ["gpu", "settle", "--power-limits", "300", "--load", "--load-device", "cpu", *QUICK]
        + ["--json"],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [c["after"] for c in doc["changes"]] == ["300 W", "stock"]
    assert all(c["power_s"] is not None for c in doc["changes"])
    limits = [c["args"] for c in setter_calls(nvml) if "PowerManagement" in c["fn"]]
    assert limits == [[300_000], [650_000]]
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_a_load_without_a_cuda_device_changes_nothing(nvml) -> None:
    pytest.importorskip("torch")
    result = CliRunner().invoke(cli, ["gpu", "settle", "--load", *QUICK])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert setter_calls(nvml) == []


def test_a_load_torch_cannot_run_is_said_in_settles_own_words(
    nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs gpu settle --load` where torch has no CUDA said "torch sees no CUDA device for
    GPU-... (CUDA_VISIBLE_DEVICES?)", and where torch is missing "`dvfs gpu roofline` needs
    torch": neither named this command or its --load-device. Each names them, and --twin."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(cli, ["gpu", "settle", "--load", *QUICK])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, said
    assert "sees no CUDA device for --load-device cuda" in said, said
    assert "--load-device cpu only runs the code path" in said and "--twin h100-sxm" in said
    assert " --device" not in said, said
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed
    result = CliRunner().invoke(cli, ["gpu", "settle", "--load", *QUICK])
    said = " ".join(result.output.split())
    assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, said
    assert "`dvfs gpu settle --load` needs torch" in said and "roofline" not in said, said
    assert setter_calls(nvml) == []


@pytest.mark.slow
def test_sigterm_restores(nvml, env, tmp_path: Path) -> None:
    clocks = ",".join(str(c) for c in range(1500, 900, -15))  # long enough to be interrupted
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvfs", "gpu", "settle", "--clocks", clocks, "--hold", "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_dispositions,
    )
    try:
        deadline = time.monotonic() + 60
        while nvml.fake_device_state(0)["locked_clocks"] is None:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "settle never locked a clock"
            time.sleep(0.02)
        assert list((tmp_path / "dvfs-state").glob("GPU-*.json"))  # recorded before changing
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output
    assert "GPU settings restored" in output and "Traceback" not in output
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_cli_a_change_that_does_not_settle_sets_the_timeout() -> None:
    """On the twin, a timeout shorter than its 0.3 s settle plus the hold leaves the changes
    unobserved, and the timeout is the settle to use."""
    result = CliRunner().invoke(
        cli,
        ["gpu", "settle", "--twin", "h100-sxm", "--clocks", "1200", "--hold", "0.2"]
        + ["--timeout", "0.4"],
    )
    assert result.exit_code == 0, result.output
    assert "Not every change settled" in result.output and "0.4 s" in result.output


def test_the_clock_not_reached_advice_names_the_setting_that_sets_the_wait(
    tmp_path: Path,
) -> None:
    """A cell whose clock missed its lock is told to wait longer after a knob change (the sweep's
    summary, `dvfs cube info`, the report). With `measurement.settle = "measured"`, the
    default, the wait is the settle timed at session start, and `knobs.settle_s` (which the
    advice named) only stands in where a change is not seen to settle: raising it changed
    nothing. `measurement.settle` in seconds is the wait."""
    from conftest import TINY, write

    from dvfs.cube.quality import INVALID_ADVICE

    def session_settle(text: str, name: str) -> float:
        campaign = write(tmp_path / f"{name}.toml", text)
        out = tmp_path / name
        result = CliRunner().invoke(cli, ["sweep", str(campaign), "-o", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        for line in (out / "journal.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["type"] == "session":
                return float(record["settle"]["settle_s"])
        raise AssertionError("no session record")

    one = TINY.replace("batch = [1, 8]", "batch = [1]").replace("repeats = 2", "repeats = 1")
    assert "settle_s = 1.0" in one and one.rstrip().endswith("idle_s = 1.0")  # [measurement]
    measured = session_settle(one, "measured")
    assert session_settle(one.replace("settle_s = 1.0", "settle_s = 7.0"), "longer") == measured
    assert session_settle(one + "settle = 0.9\n", "seconds") == 0.9 != measured
    advice = INVALID_ADVICE["clock_not_reached"]
    assert "measurement.settle" in advice and "knobs.settle_s" not in advice


def test_ctrl_c_with_a_restore_nvml_refuses_exits_as_interrupted_naming_the_state_folder(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while a clock is locked, and NVML refusing to unlock it: `gpu settle` ends as a
    sweep does (exit 130, the GPU named as NOT restored, the `dvfs gpu reset` to run and the
    state folder, printed as it is even with brackets), not exit 1 with the restore's error."""
    import dvfs.measure.settle as settle_module

    state = tmp_path / "st[/]ate"
    monkeypatch.setenv("DVFS_STATE_DIR", str(state))
    nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 999})
    timed = settle_module.measure_settle

    def interrupted_after_the_first_change(*args, **kwargs):
        timed(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(settle_module, "measure_settle", interrupted_after_the_first_change)
    result = CliRunner().invoke(cli, ["gpu", "settle", "--clocks", "1500", *QUICK])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 130, result.output
    assert "GPU settings NOT fully restored" in said, said
    assert f"(state in {state})" in said and "dvfs gpu reset --state-dir" in said, said
    assert "Traceback" not in result.output
    assert list(state.glob("GPU-*.json")), "the state file that the reset reads is kept"


def test_settle_help_says_which_clocks_it_locks_by_default() -> None:
    """`gpu settle --help` gave the highest supported clock and the one nearest half of it as
    --clocks' default, but with --power-limits and no --clocks no clock is locked at all: the
    help says so, and the run steps the power limits alone."""
    runner = CliRunner()
    help_text = " ".join(runner.invoke(cli, ["gpu", "settle", "--help"]).output.split())
    assert "nearest half of it; none with --power-limits]" in help_text, help_text
    alone = runner.invoke(
        cli, ["gpu", "settle", "--twin", "h100-sxm", "--load", "--power-limits", "300", "--json"]
    )
    assert alone.exit_code == 0, alone.output
    changes = [(c["before"], c["after"]) for c in json.loads(alone.output)["changes"]]
    assert changes == [("stock", "300 W"), ("300 W", "stock")], changes
    default = runner.invoke(cli, ["gpu", "settle", "--twin", "h100-sxm", "--json"])
    assert default.exit_code == 0, default.output
    locked = [c["after"] for c in json.loads(default.output)["changes"]]
    assert locked == ["1980 MHz", "990 MHz", "stock"], locked
