"""A cell is labelled with the knobs the GPU really ran at: a power limit changed or capped
outside dvfs (an admin's `nvidia-smi -pl`, a BMC or rack cap) is set again or flags the cells,
and a clock lock set outside dvfs flags the stock-clock cells. Runs dvfs's real NVML backend
against the fake pynvml, with the twin engine as the workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvml_support import (  # root_env, fresh_nvml: this module's `env` and `nvml` fixtures
    NVML_CAMPAIGN,
    cube_as_on_an_idle_machine,
    dvfs_in_process,
    fresh_nvml,  # noqa: F401
    root_env,  # noqa: F401
)

from dvfs.backends import Backends
from dvfs.campaign import load_campaign
from dvfs.clock import MonotonicClock
from dvfs.engines.twin import TwinEngine
from dvfs.gpu.base import (
    EVENT_APPLICATIONS_CLOCKS,
    EVENT_GPU_IDLE,
    EVENT_HW_THERMAL,
    EVENT_SW_POWER_CAP,
    EVENT_SYNC_BOOST,
)
from dvfs.gpu.knobs import KnobController, KnobSetting
from dvfs.gpu.nvml import open_nvml_gpus
from dvfs.measure.journal import iter_records
from dvfs.measure.meter import INVALIDATING, describe_quality
from dvfs.sweep import run_sweep
from dvfs.twin.device import FreeRunningNode
from dvfs.twin.profiles import gpu_profile, model_profile

SET_LIMIT = "nvmlDeviceSetPowerManagementLimit"


def campaign_text(**replace: str) -> str:
    """The small NVML campaign with windows long enough for valid cells on the fake's 20 ms
    energy counter, and `replace`'s lines swapped in."""
    text = NVML_CAMPAIGN.format(output_tokens=128, repeats=1)
    text = text.replace("[measurement]\n", "[measurement]\nprecision = 0.05\n")
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return text


def cells(journal: Path) -> list[dict]:
    return [r for r in iter_records(journal) if r.get("type") == "cell"]


def flags(record: dict) -> list[str]:
    return describe_quality(int(record["measurement"]["quality"]))


# -- the fake ---------------------------------------------------------------------------------


def test_the_fake_enforces_an_out_of_band_limit_below_the_configured_one(nvml) -> None:
    nvml.nvmlInit()
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        nvml.fake_set_load(0, 1.0)
        assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
        assert not nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & 0x4
        nvml.fake_update_device(0, oob_power_limit_mw=400_000)  # a BMC cap
        assert nvml.nvmlDeviceGetPowerManagementLimit(h) == 700_000  # configured: unchanged
        assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 400_000
        assert nvml.nvmlDeviceGetPowerUsage(h) <= 400_000  # the cap holds the power down
        assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & 0x4  # SwPowerCap
        nvml.nvmlDeviceSetPowerManagementLimit(h, 300_000)  # below the cap: the lower wins
        assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 300_000
        nvml.fake_update_device(0, oob_power_limit_mw=None)
        assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 300_000
    finally:
        nvml.nvmlShutdown()


# -- the controller ---------------------------------------------------------------------------


def test_apply_sets_again_a_limit_changed_outside_dvfs(nvml) -> None:
    with open_nvml_gpus([0], nvml=nvml) as gpus, KnobController(gpus) as knobs:
        assert knobs.apply(KnobSetting(None, 400.0))
        nvml.fake_update_device(0, power_limit_mw=450_000)  # an admin's `nvidia-smi -pl 450`
        assert knobs.apply(KnobSetting(None, 400.0))  # read back, differs: written again
        assert nvml.fake_device_state(0)["power_limit_mw"] == 400_000
        assert not knobs.apply(KnobSetting(None, 400.0))  # as wanted: nothing written
    writes = [c["args"] for c in nvml.fake_calls(SET_LIMIT)]
    assert writes == [[400_000], [400_000], [700_000]]  # the last: the restore
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


@pytest.mark.parametrize(
    ("setter", "setting"),
    [
        (SET_LIMIT, KnobSetting(None, 400.0)),
        ("nvmlDeviceSetGpuLockedClocks", KnobSetting(1500, None)),
    ],
)
def test_a_setter_the_gpu_does_not_support_changes_nothing_to_restore(
    nvml, setter: str, setting: KnobSetting
) -> None:
    """NVML's NOT_SUPPORTED from a setter (a GPU or driver without that knob) changed nothing,
    as a refused permission or value did not: the error says so, and the restore neither
    writes the knob back nor fails over it (it had, hiding the first error under "could not
    restore GPU settings" and leaving a state file)."""
    from dvfs.errors import GpuNotSupportedError

    nvml.fake_update_device(0, errors={setter: nvml.NVML_ERROR_NOT_SUPPORTED})
    with (
        pytest.raises(GpuNotSupportedError) as refused,
        open_nvml_gpus([0], nvml=nvml) as gpus,
        KnobController(gpus) as knobs,
    ):
        knobs.apply(setting)
    if setter == SET_LIMIT:  # the range is no answer to "not supported"
        assert "allowed" not in str(refused.value) and "does not let" in str(refused.value)
    assert len(nvml.fake_calls(setter)) == 1  # the refused write, none to restore
    assert nvml.fake_calls("nvmlDeviceResetGpuLockedClocks") == []
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


def test_a_limit_nvml_calls_invalid_is_answered_with_the_allowed_range(nvml) -> None:
    from dvfs.errors import GpuValueError

    nvml.fake_update_device(0, errors={SET_LIMIT: nvml.NVML_ERROR_INVALID_ARGUMENT})
    with (
        pytest.raises(GpuValueError, match="allowed 200-700 W") as refused,
        open_nvml_gpus([0], nvml=nvml) as gpus,
        KnobController(gpus) as knobs,
    ):
        knobs.apply(KnobSetting(None, 400.0))
    assert "does not let" not in str(refused.value)


@pytest.mark.parametrize("error", ["NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION"])
def test_a_refused_clock_restore_still_puts_the_power_limit_back(nvml, error: str) -> None:
    """NVML refusing the clock's reset on restore changed nothing, and says nothing of the
    power limit: that is put back still (it was left at 400 W, and `dvfs gpu reset` stopped
    at the same clock reset); the error names the clock, whose lock stays."""
    from dvfs.errors import GpuError

    with (
        pytest.raises(GpuError, match="cannot reset locked SM clocks"),
        open_nvml_gpus([0], nvml=nvml) as gpus,
        KnobController(gpus) as knobs,
    ):
        knobs.apply(KnobSetting(1500, 400.0))
        reset = {"nvmlDeviceResetGpuLockedClocks": getattr(nvml, error)}
        nvml.fake_update_device(0, errors=reset)
    state = nvml.fake_device_state(0)
    assert state["power_limit_mw"] == 700_000
    assert state["locked_clocks"] == [1500, 1500]


# -- the quality check ------------------------------------------------------------------------


def test_a_limit_not_held_is_an_invalidating_flag() -> None:
    from dvfs.measure.meter import Q_POWER_LIMIT_NOT_HELD, PowerLimitRead, power_limit_quality

    held = PowerLimitRead(400_000, (400_000, 400_000), (400_000, 400_000))
    assert held.held and power_limit_quality([held]) == 0
    assert power_limit_quality([]) == 0
    changed = PowerLimitRead(400_000, (400_000, 450_000), (400_000, 450_000))
    capped = PowerLimitRead(700_000, (700_000, 700_000), (500_000, 500_000))
    unknown_enforced = PowerLimitRead(700_000, (700_000, 700_000), ())
    assert unknown_enforced.held
    for read in (changed, capped):
        assert not read.held
        assert power_limit_quality([held, read]) == Q_POWER_LIMIT_NOT_HELD
    # An in-flight group's read: the configured limit moves with the levels, only an
    # enforced one below the lowest level's is not held.
    group = PowerLimitRead(400_000, (700_000, 400_000), (700_000, 400_000), group=True)
    assert group.held and group.to_json()["group"] is True
    assert not PowerLimitRead(400_000, (700_000, 700_000), (350_000, 700_000), group=True).held
    assert "group" not in held.to_json()
    assert Q_POWER_LIMIT_NOT_HELD & INVALIDATING
    assert describe_quality(Q_POWER_LIMIT_NOT_HELD) == ["power_limit_not_held"]


# -- end to end -------------------------------------------------------------------------------


def test_an_out_of_band_limit_flags_the_cells_it_caps_and_headroom_skips_them(
    nvml, env, tmp_path: Path
) -> None:
    campaign = tmp_path / "nvml.toml"
    # One clock: the flag follows the power limit alone.
    campaign.write_text(campaign_text(**{"sm_clock = [1980, 1500]": "sm_clock = [1980]"}))
    nvml.fake_update_device(0, oob_power_limit_mw=500_000)  # a rack cap dvfs cannot lift
    out = tmp_path / "out"
    done = dvfs_in_process("sweep", str(campaign), "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    records = cells(out / "journal.jsonl")
    assert len(records) == 2
    for record in records:
        [read] = record["power_limits"]
        limit = record["cell"]["power_limit_w"]
        assert read["target_mw"] == round(limit * 1000)
        assert read["enforced_mw"] == [min(read["target_mw"], 500_000)] * 2
        assert ("power_limit_not_held" in flags(record)) == (limit == 700)
    cube = cube_as_on_an_idle_machine(out, env)
    preserve = dvfs_in_process("headroom", cube, "--json", env=env)
    assert preserve.returncode == 0, preserve.stdout + preserve.stderr
    [row] = json.loads(preserve.stdout)["rows"]
    # The stock 700 W reference ran capped at 500 W: no answer, and it says why.
    assert row["reference_problem"] == "invalid: power_limit_not_held"
    assert row["chosen"]["power_limit_w"] is None
    table = dvfs_in_process("headroom", cube, env=env).stdout
    assert "no valid reference cell (invalid: power_limit_not_held)" in table
    from dvfs.report.reasons import no_answer_advice

    assert no_answer_advice(row).startswith("power_limit_not_held: the GPU's power limit was")
    # An absolute SLO needs no reference: it chooses among the cells that held their limit.
    slo = dvfs_in_process("headroom", cube, "--slo", "tpot_p50<=10s", "--json", env=env)
    [row] = json.loads(slo.stdout)["rows"]
    assert row["chosen"]["power_limit_w"] == 400.0
    assert row["invalid_settings"] == 1  # the 700 W cell, left out


def sweep_in_process(path: Path, tmp_path: Path, nvml, wrap):
    """Sweep the campaign at `path` on fake NVML GPU 0 in this process, its twin engine
    wrapped by `wrap` (an engine that changes the GPU mid-sweep, as an admin would; a CLI run
    has no hook for that), into tmp_path/out; the sweep's outcome."""
    clock = MonotonicClock()
    twin = TwinEngine(
        FreeRunningNode(gpu_profile("h100-sxm"), clock), model_profile("llama-3.1-8b")
    )
    with open_nvml_gpus([0], nvml=nvml) as gpus:
        return run_sweep(
            load_campaign(path),
            tmp_path / "out",
            backends=Backends(clock, list(gpus), wrap(twin)),
            state_dir=tmp_path / "dvfs-state",
        )


class ChangingEngine:
    """The twin engine; after its first round an admin sets the power limit to 450 W."""

    name = "twin"

    def __init__(self, inner: TwinEngine, nvml) -> None:
        self.inner, self.nvml, self.runs = inner, nvml, 0

    def start(self, drafter):
        return self.inner.start(drafter)

    def run(self, workload, *args):
        result = self.inner.run(workload, *args)
        self.runs += 1
        if self.runs == 1:
            self.nvml.fake_update_device(0, power_limit_mw=450_000)
        return result

    def stop(self) -> None:
        self.inner.stop()


def test_a_limit_changed_between_cells_is_set_again_and_flags_its_cell(
    nvml, tmp_path: Path
) -> None:
    path = tmp_path / "nvml.toml"
    path.write_text(
        NVML_CAMPAIGN.format(output_tokens=16, repeats=1).replace(
            "power_limit = [700, 400]", "power_limit = [700]"
        )
    )
    outcome = sweep_in_process(path, tmp_path, nvml, lambda twin: ChangingEngine(twin, nvml))
    assert outcome.summary.measured == 2
    first, second = cells(tmp_path / "out" / "journal.jsonl")
    # The cell the change happened in ran partly at 450 W: flagged, its read says so.
    assert first["power_limits"][0]["configured_mw"] == [700_000, 450_000]
    assert "power_limit_not_held" in flags(first)
    # The next cell found 450 W and set its 700 W again before measuring.
    assert second["power_limits"][0]["configured_mw"] == [700_000, 700_000]
    assert "power_limit_not_held" not in flags(second)
    assert [c["args"] for c in nvml.fake_calls(SET_LIMIT)] == [[700_000]]
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


# -- a clock lock set outside dvfs ------------------------------------------------------------


@pytest.mark.parametrize(
    ("clock", "reasons", "stock_clock", "held_low"),
    [
        (1200, 0, 1980, True),  # held low, nothing NVML names explains it
        (1200, EVENT_APPLICATIONS_CLOCKS, 1980, True),
        (1980, EVENT_APPLICATIONS_CLOCKS, 1980, False),  # 0x2 at full clock: nothing held down
        (1960, 0, 1980, False),  # within the tolerance
        (1500, EVENT_SW_POWER_CAP, 1980, False),  # the power limit held it down
        (1500, EVENT_HW_THERMAL, 1980, False),  # throttled instead
        (1500, EVENT_GPU_IDLE, 1980, False),  # not under load
        # a sync-boost group held it to another GPU's clock: not this GPU's stock
        (1500, EVENT_SYNC_BOOST, 1980, True),
        (1500, EVENT_SYNC_BOOST | EVENT_APPLICATIONS_CLOCKS, 1980, True),
        (1500, EVENT_SYNC_BOOST | EVENT_SW_POWER_CAP, 1980, False),
        (1200, EVENT_APPLICATIONS_CLOCKS, None, False),  # a locked cell: dvfs's own lock
    ],
)
def test_a_stock_clock_cell_held_low_is_flagged(clock, reasons, stock_clock, held_low) -> None:
    from test_meter import part

    from dvfs.measure.meter import Q_CLOCK_HELD_LOW, summarise

    m = summarise(
        [part(clock=clock, reasons=reasons)],
        requested_clock_mhz=None,
        stock_clock_mhz=stock_clock,
        min_window_s=0.05,
        sample_period_s=0.025,
        idle_power_w=75.0,
        precision=0.5,
    )
    assert bool(m.quality & Q_CLOCK_HELD_LOW) is held_low
    assert Q_CLOCK_HELD_LOW & INVALIDATING
    if reasons & EVENT_SYNC_BOOST:  # the advice names the cause
        from dvfs.cube.quality import INVALID_ADVICE

        assert "sync-boost group" in INVALID_ADVICE["clock_held_low"]
    assert describe_quality(Q_CLOCK_HELD_LOW) == ["clock_held_low"]


def test_the_fake_reports_a_held_lock_and_runs_at_it_under_load(nvml) -> None:
    nvml.fake_set_load(0, 1.0)
    nvml.fake_update_device(0, locked_clocks=[1200, 1200])  # `nvidia-smi -lgc 1200`
    readings = nvml.fake_device_state(0)["readings"]
    assert readings["sm_clock_mhz"] == 1200
    assert readings["reasons"] == nvml.nvmlClocksEventReasonUserDefinedClocks == 0x2
    nvml.fake_update_device(0, locked_clocks=None)
    assert nvml.fake_device_state(0)["readings"]["reasons"] == 0


def test_a_lock_set_outside_dvfs_flags_the_stock_cells_and_headroom_says_why(
    nvml, env, tmp_path: Path
) -> None:
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(campaign_text(**{"sm_clock = [1980, 1500]": 'sm_clock = "stock"'}))
    nvml.fake_set_load(0, 1.0)  # the GPU busy throughout, as under a decode
    nvml.fake_update_device(0, locked_clocks=[1200, 1200])  # an admin's `nvidia-smi -lgc 1200`
    out = tmp_path / "out"
    done = dvfs_in_process("sweep", str(campaign), "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "GPU 0 reports ApplicationsClocksSetting (0x2)" in said
    records = cells(out / "journal.jsonl")
    assert len(records) == 2
    for record in records:
        assert record["measurement"]["sm_clock_observed_mhz"] == 1200
        assert "clock_held_low" in flags(record)
    # dvfs never touched the clocks, so it leaves the lock it cannot read back as it was.
    assert nvml.fake_device_state(0)["locked_clocks"] == [1200, 1200]
    assert "2 of 2 measured cell(s) are invalid" in said and "clock_held_low x2" in said
    # Nothing valid is left to analyse, and headroom says so.
    refused = dvfs_in_process("headroom", str(out / "cube.nc"), env=env)
    assert refused.returncode == 1 and "has no valid measured cell" in refused.stderr


def test_observe_only_measures_stock_as_it_finds_it_an_operators_lock_included(
    nvml, env, tmp_path: Path
) -> None:
    """--observe-only: the knob dimensions hold the stock settings as observed, so a lock the
    operator set is what the GPU runs at, not a fault: no cell is flagged clock_held_low."""
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(campaign_text(**{"sm_clock = [1980, 1500]": 'sm_clock = "stock"'}))
    nvml.fake_set_load(0, 1.0)
    nvml.fake_update_device(0, locked_clocks=[1200, 1200])
    out = tmp_path / "out"
    done = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--observe-only", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # The lock is named, and said not to flag anything: observe-only neither flags nor restores.
    said = " ".join((done.stdout + done.stderr).split())
    assert "GPU 0 reports ApplicationsClocksSetting (0x2)" in said
    assert "will be flagged clock_held_low" not in said and "restores" not in said, said
    assert "not flagged clock_held_low" in said, said
    records = cells(out / "journal.jsonl")
    assert records
    for record in records:
        assert record["measurement"]["sm_clock_observed_mhz"] == 1200
        assert "clock_held_low" not in flags(record)
    assert nvml.fake_device_state(0)["locked_clocks"] == [1200, 1200]
    # The cube files the stock cells at the maximum clock; what dvfs says of the reference
    # tells it was observed as found, and at which clock the GPU ran.
    import dvfs
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts

    info = dvfs_in_process("cube", "info", str(out), "--json", env=env)
    stock = json.loads(info.stdout)["stock"]
    assert "observe-only: dvfs changed no knob" in stock and "ran at 1200 MHz" in stock, stock
    assert "SM clock left unlocked" not in stock
    section = measured_section(dvfs.open_cube(out))
    facts = dict(next(b for b in section.blocks if isinstance(b, Facts)).pairs)
    assert facts["Reference"] == stock


class LockingEngine(ChangingEngine):
    """The twin engine; as its second round starts an admin locks the clocks at 1200 MHz
    (`lock`), or unlocks the ones locked before the sweep."""

    def __init__(self, inner: TwinEngine, nvml, lock: bool) -> None:
        super().__init__(inner, nvml)
        self.lock = lock

    def run(self, workload, *args):
        self.runs += 1
        if self.runs == 2:
            self.nvml.fake_update_device(0, locked_clocks=[1200, 1200] if self.lock else None)
        return self.inner.run(workload, *args)


@pytest.mark.parametrize("lock_during", [True, False], ids=["locked-during", "unlocked-during"])
def test_a_lock_during_a_sweep_flags_the_stock_cells_it_held(
    nvml, env, tmp_path: Path, lock_during: bool
) -> None:
    path = tmp_path / "nvml.toml"
    path.write_text(campaign_text(**{"sm_clock = [1980, 1500]": 'sm_clock = "stock"'}))
    nvml.fake_set_load(0, 1.0)
    if not lock_during:
        nvml.fake_update_device(0, locked_clocks=[1200, 1200])
    outcome = sweep_in_process(
        path, tmp_path, nvml, lambda twin: LockingEngine(twin, nvml, lock_during)
    )
    first, second = cells(tmp_path / "out" / "journal.jsonl")
    assert first["cell"]["power_limit_w"] == 700  # the stock limit: the reference
    held, free = (second, first) if lock_during else (first, second)
    assert held["measurement"]["sm_clock_observed_mhz"] == 1200
    assert "clock_held_low" in flags(held)
    # Unlocked: at the maximum, or at 400 W as far as the power limit lets it (SwPowerCap).
    assert free["measurement"]["sm_clock_observed_mhz"] > 1500
    assert "clock_held_low" not in flags(free)
    assert outcome.cube_path == tmp_path / "out" / "cube.nc"
    cube = cube_as_on_an_idle_machine(tmp_path / "out", env)
    [row] = json.loads(dvfs_in_process("headroom", cube, "--json", env=env).stdout)["rows"]
    if lock_during:  # the 400 W cell ran locked: never chosen
        assert row["chosen"]["power_limit_w"] == 700.0 and row["invalid_settings"] == 1
        return
    # The reference ran locked: no answer, in the words every no-answer uses, with the advice.
    assert row["reference_problem"] == "invalid: clock_held_low"
    assert row["chosen"]["power_limit_w"] is None
    table = " ".join(dvfs_in_process("headroom", cube, env=env).stdout.split())
    assert "no valid reference cell (invalid: clock_held_low)" in table
    from dvfs.report.reasons import no_answer_advice  # the report's and cap plan's advice

    advice = no_answer_advice(row)
    assert advice.startswith("clock_held_low: a stock-clock cell ran below the maximum clock")
    assert "nvidia-smi -rgc" in advice


def test_doctor_warns_of_a_lock_and_a_limit_held_outside_dvfs(nvml, env, tmp_path: Path) -> None:
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(campaign_text())
    clean = dvfs_in_process("doctor", str(campaign), env=env)
    said = " ".join(clean.stdout.split())
    assert "no clock lock or power limit held outside dvfs seen" in said, said
    nvml.fake_update_device(0, locked_clocks=[1200, 1200], oob_power_limit_mw=500_000)
    held = " ".join(dvfs_in_process("doctor", str(campaign), env=env).stdout.split())
    assert "reports ApplicationsClocksSetting (0x2)" in held, held
    assert "enforces 500 W below its configured 700 W" in held
    # An observe-only campaign measures the GPU as it is set: the lock is named, not said to
    # flag cells.
    observe = tmp_path / "observe.toml"
    observe.write_text(
        campaign_text(
            **{
                "sm_clock = [1980, 1500]": 'sm_clock = "stock"',
                "power_limit = [700, 400]": 'power_limit = "stock"',
                'backend = "nvml"': 'backend = "nvml"\nactuation = "off"',
            }
        )
    )
    watched = dvfs_in_process("doctor", str(observe), env=env)
    said = " ".join(watched.stdout.split())
    assert "reports ApplicationsClocksSetting (0x2)" in said, said
    assert "would be flagged clock_held_low" not in said
    assert "its cells not flagged clock_held_low" in said


@pytest.mark.parametrize(
    "earlier_for", [450_000, None], ids=["this-dvfs", "written-before-earlier-for"]
)
def test_doctor_names_dvfs_earlier_power_cap_a_signal_left_as_dvfs(
    nvml, env, tmp_path: Path, earlier_for: int | None
) -> None:
    """`systemctl stop dvfs-caps` ending `cap apply`'s change from dvfs's 500 W cap to 450 W
    before it landed leaves the GPU at 500 W, recorded as dvfs's too (power_limit_earlier_mw),
    which the sweep lifts while it measures (stock at the default); `dvfs doctor` took the
    500 W for the GPU's own stock and named no dvfs caps in force. It names it, as the sweep
    takes it; so too in a record the dvfs before power_limit_earlier_for_mw wrote, read after
    an upgrade (it wrote the earlier cap only beside the cap it was changing to; taken for
    stale, the sweep measured dvfs's 500 W cap as the GPU's stock)."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    applied = dvfs_in_process("cap", "apply", str(caps), env=env)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # as the stop leaves it: the record's 450 W beside the earlier 500 W the GPU still holds
    record = Path(env["DVFS_STATE_DIR"]) / "caps-applied.json"
    entries = json.loads(record.read_text())
    entries[uuid]["power_limit_earlier_mw"] = 500_000
    if earlier_for is not None:  # (beside the cap it was changing to; none said before it)
        entries[uuid]["power_limit_earlier_for_mw"] = earlier_for
    record.write_text(json.dumps(entries))
    nvml.fake_update_device(0, power_limit_mw=500_000)
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(campaign_text())
    said = " ".join(dvfs_in_process("doctor", str(campaign), env=env).stdout.split())
    assert "dvfs caps in force: GPU 0 (power limit 500 W); the sweep lifts them" in said, said
    # one the operator set since is theirs: the GPU's stock, as the sweep takes it
    nvml.fake_update_device(0, power_limit_mw=550_000)
    said = " ".join(dvfs_in_process("doctor", str(campaign), env=env).stdout.split())
    assert "dvfs caps in force" not in said, said
