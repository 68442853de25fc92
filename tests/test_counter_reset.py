"""An energy counter reset mid-sweep (a driver reload or a GPU reset restarts NVML's total-energy
counter from zero) must not be taken for energy: the idle baselines measure from after it,
and a cell's window across it is invalid (counter_stalled)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import replace_block

import dvfs.measure.baseline as baseline_module
import dvfs.measure.runner as runner_module
from dvfs.cli import cli
from dvfs.clock import VirtualClock
from dvfs.errors import GpuError
from dvfs.gpu.twin import TwinGpu
from dvfs.measure.baseline import idle_baseline
from dvfs.measure.journal import read_records
from dvfs.measure.sampler import measure_idle_power_w
from tests.test_baseline import IdleGpu
from tests.test_opening_idle import CAMPAIGN as SHORT_IDLE

#: The opening-idle campaign on a tensor-parallel server of two GPUs, an idle baseline at
#: each setting (as by default).
CAMPAIGN = replace_block(
    replace_block(
        replace_block(
            replace_block(SHORT_IDLE, 'name = "short-idle"', 'name = "counter-reset"'),
            "devices = [0]",
            "devices = [0, 1]",
        ),
        'model = "llama-3.1-8b"\n',
        'model = "llama-3.1-8b"\ntp_size = 2\n',
    ),
    "idle_s = {idle_s}\nidle_per_setting = false\n",
    "idle_s = 1.0\n",
)


class ResettingIdleGpu(IdleGpu):
    """An idle GPU whose counter, counting since a driver load long ago (10^9 mJ), restarts
    from zero at `reset_s` (virtual time)."""

    def __init__(self, clock: VirtualClock, reset_s: float, **kwargs: Any) -> None:
        super().__init__(clock, **kwargs)
        self.reset_s = reset_s
        self._at_reset: int | None = None

    def energy_mj(self) -> int:
        value = super().energy_mj()
        if self.clock.now_ns() / 1e9 < self.reset_s:
            return 10**9 + value
        if self._at_reset is None:
            self._at_reset = value
        return value - self._at_reset


def test_an_idle_baseline_counts_from_after_a_counter_reset() -> None:
    clock = VirtualClock()
    gpus = [ResettingIdleGpu(clock, 0.5), IdleGpu(clock, index=1, phase_s=0.061)]
    result = idle_baseline(gpus, clock, min_s=1.0, sample_period_s=0.01, min_updates=10)
    assert result.enough and result.source == "energy counter"
    assert result.power_w == pytest.approx(gpus[0].watts() + gpus[1].watts(), rel=1e-3)


def test_the_opening_idle_is_measured_again_after_a_counter_reset() -> None:
    clock = VirtualClock()
    gpu = ResettingIdleGpu(clock, 0.5)
    assert measure_idle_power_w([gpu], clock, 1.0) == pytest.approx(gpu.watts(), rel=1e-2)
    assert clock.now_ns() == pytest.approx(2e9, rel=1e-3)  # two tries of 1 s


def test_a_counter_that_keeps_going_backwards_is_refused() -> None:
    clock = VirtualClock()

    class Backwards(IdleGpu):
        def energy_mj(self) -> int:
            return 10**9 - clock.now_ns() // 1000

    with pytest.raises(GpuError, match="energy counter of GPU 0 went backwards"):
        measure_idle_power_w([Backwards(clock)], clock, 1.0)


def _sweep(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    campaign = tmp_path / "campaign.toml"
    campaign.write_text(CAMPAIGN)
    out = tmp_path / name
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return read_records(out / "journal.jsonl")


def test_a_counter_reset_during_the_idle_baselines_does_not_make_idle_power_negative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 1's counter restarts from zero in the middle of the session's opening idle
    measurement and of the idle baseline at the cell's setting: both idle powers, and the
    cell's energy per token above idle, are those of a sweep without the resets."""
    reference = _sweep(tmp_path, "reference")
    reset_at: list[int] = []  # the instants GPU 1's counter restarts from zero
    offsets: dict[int, int] = {}  # its reading at each reset, taken when first read after it

    def reset(gpu: TwinGpu, t_ns: np.ndarray, energy_mj: np.ndarray) -> np.ndarray:
        if gpu.device.index != 1:
            return energy_mj
        out = np.array(energy_mj, dtype=np.int64)
        for i, t in enumerate(np.asarray(t_ns).tolist()):
            since = [r for r in reset_at if r <= t]
            if since:  # energy since the last reset
                offsets.setdefault(since[-1], int(energy_mj[i]))
                out[i] = int(energy_mj[i]) - offsets[since[-1]]
        return out

    readings_at, readings_of, energy_mj = (
        TwinGpu.readings_at,
        TwinGpu.readings_of,
        TwinGpu.energy_mj,
    )

    def patched_at(self: TwinGpu, t_ns: np.ndarray) -> Any:
        r = readings_at(self, t_ns)
        return dataclasses.replace(r, energy_mj=reset(self, t_ns, r.energy_mj))

    def patched_of(self: TwinGpu, state: object, t_ns: np.ndarray) -> Any:
        r = readings_of(self, state, t_ns)
        return dataclasses.replace(r, energy_mj=reset(self, t_ns, r.energy_mj))

    def patched_energy(self: TwinGpu) -> int:
        now = np.array([self.device.clock.now_ns()])
        return int(reset(self, now, np.array([energy_mj(self)]))[0])

    opening, per_setting = runner_module.measure_idle_power_w, baseline_module.idle_baseline

    def opening_with_reset(gpus: Any, clock: Any, seconds: float) -> float:
        reset_at.append(clock.now_ns() + round(seconds / 2 * 1e9))
        return opening(gpus, clock, seconds)

    def per_setting_with_reset(gpus: Any, clock: Any, **kwargs: Any) -> Any:
        reset_at.append(clock.now_ns() + round(0.3e9))
        return per_setting(gpus, clock, **kwargs)

    monkeypatch.setattr(TwinGpu, "readings_at", patched_at)
    monkeypatch.setattr(TwinGpu, "readings_of", patched_of)
    monkeypatch.setattr(TwinGpu, "energy_mj", patched_energy)
    monkeypatch.setattr(runner_module, "measure_idle_power_w", opening_with_reset)
    monkeypatch.setattr(baseline_module, "idle_baseline", per_setting_with_reset)
    records = _sweep(tmp_path, "reset")
    assert len(reset_at) == 2  # the opening idle and the cell's setting's baseline

    def the(kind: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
        (record,) = [r for r in recs if r["type"] == kind]
        return record

    assert the("session", records)["idle_power_w"] == pytest.approx(
        the("session", reference)["idle_power_w"], rel=0.02
    )
    got, want = the("cell", records)["measurement"], the("cell", reference)["measurement"]
    assert got["valid"] and got["idle_power_w"] == pytest.approx(want["idle_power_w"], rel=0.01)
    assert 0 < got["energy_per_token_above_idle_j"] < got["energy_per_token_j"]
    assert got["energy_per_token_above_idle_j"] == pytest.approx(
        want["energy_per_token_above_idle_j"], rel=0.05
    )
    assert not math.isnan(got["energy_per_token_j"])


def _reset_round(periods: tuple[float | None, ...], gpus: int) -> Any:
    """A round of 1.2 s read every 10 ms, its window 0.1-1.0 s: each GPU's counter steps every
    100 ms at 100 W; GPU 0's (gpus == 1) or GPU 1's, loaded shortly before (5 J counted),
    restarts from zero at 0.55 s: its difference across the window is positive, 60 J short."""
    from dvfs.engines.base import RequestTrace, RoundResult
    from dvfs.measure.meter import WindowPart

    t = np.arange(0, 1_200_000_000, 10_000_000, dtype=np.int64)
    step = t // 100_000_000 * 100_000_000
    steady = 10**9 + step // 10_000
    reset = np.where(step < 550_000_000, 5_000 + step // 10_000, (step - 550_000_000) // 10_000)
    energy = np.stack([steady, reset] if gpus == 2 else [reset], axis=1).astype(np.int64)
    tokens = np.ones(len(t), dtype=np.int64)
    trace = RequestTrace(0, t, tokens, 10, int(tokens.sum()), "length")
    samples = {
        "t_ns": t,
        "energy_mj": energy.sum(axis=1),
        "power_mw": np.full(len(t), 100_000 * gpus),
        "sm_clock_mhz": np.full(len(t), 1500),
        "temperature_c": np.full(len(t), 60),
        "reasons": np.zeros(len(t), dtype=np.int64),
        "sm_clock_max_mhz": np.full(len(t), 1500),
        "gpu_energy_mj": energy,
        "gpu_energy_t_ns": np.repeat(t[:, None], gpus, axis=1),
    }
    return WindowPart(RoundResult((trace,), 0, int(t[-1])), (100_000_000, 1_000_000_000), samples)


@pytest.mark.parametrize(
    ("periods", "gpus"),
    [((0.1,), 1), ((None,), 1), ((0.0,), 1), ((0.1, 0.1), 2)],
    ids=["fitted", "unknown-period", "continuous", "tensor-parallel"],
)
def test_a_counter_reset_inside_a_window_invalidates_the_cell(
    periods: tuple[float | None, ...], gpus: int
) -> None:
    """A counter that restarts from zero inside a round's window from a count lower than the
    window's energy after it (a driver loaded shortly before, as after an earlier reload):
    the difference across the window is positive, a quarter of the energy spent, and was kept
    as a valid cell's energy per token. Repro: `round_energy` on these readings gave 20 J over
    0.8 s at 100 W, stalled False."""
    from dvfs.measure.meter import Q_COUNTER_STALLED, summarise

    m = summarise(
        [_reset_round(periods, gpus)],
        requested_clock_mhz=None,
        min_window_s=0.5,
        sample_period_s=0.01,
        idle_power_w=75.0,
        counter_periods_s=periods,
        precision=0.5,
    )
    assert m.quality & Q_COUNTER_STALLED and not m.valid, describe(m.quality)


def test_a_steady_counter_in_the_same_round_is_valid() -> None:
    """The same round without the reset: valid, at 100 W per GPU (the check costs no cell)."""
    from dvfs.measure.meter import summarise

    part = _reset_round((0.1,), 1)
    steady = 10**9 + part.samples["t_ns"] // 100_000_000 * 100_000_000 // 10_000
    part.samples["gpu_energy_mj"] = steady[:, None]
    part.samples["energy_mj"] = steady
    m = summarise(
        [part],
        requested_clock_mhz=None,
        min_window_s=0.5,
        sample_period_s=0.01,
        idle_power_w=75.0,
        counter_periods_s=(0.1,),
        precision=0.5,
    )
    assert m.valid and m.quality == 0, describe(m.quality)
    assert m.power_mean_w == pytest.approx(100.0)


def describe(mask: int) -> list[str]:
    from dvfs.measure.meter import describe_quality

    return describe_quality(mask)
