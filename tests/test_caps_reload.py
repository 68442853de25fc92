"""A driver reloaded in the same boot (rmmod/modprobe, an update without a reboot) after the
caps unit applied its caps: `cap reset --applied` (the unit's stop) must not put back a limit
the old driver had, above the new driver's default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from nvml_support import installed_nvml  # noqa: F401  (this module's `nvml` fixture)

from dvfs.caps import CapsFile, GpuCap, dump_caps
from dvfs.cli import cli


def _cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_reset_after_a_reload_whose_default_is_the_cap_keeps_the_new_default(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caps unit capped GPU 0 at 450 W (from its 700 W default); the driver was then
    reloaded in the same boot, its new default 450 W, which the GPU took: equal to dvfs's cap,
    so `cap reset --applied` took it for dvfs's and put back the 700 W the old driver had,
    above the GPU's stock now, a setting never measured. It puts back the default now."""
    uuid = json.loads(_cli("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    _cli("cap", "apply", str(caps))
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    monkeypatch.setitem(nvml.FAKE_PROFILES["h100-sxm"], "power_default_mw", 450_000)
    nvml.fake_update_device(0, power_limit_mw=450_000)  # the reloaded driver's default
    out = " ".join(_cli("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000, out
    assert "default" in out and "700 W" in out, out


def test_reset_without_a_reload_puts_back_the_limit_the_cap_replaced(nvml, tmp_path: Path) -> None:
    """No reload: an operator's 600 W that dvfs's 450 W cap replaced comes back, as before."""
    uuid = json.loads(_cli("gpu", "list", "--json"))[0]["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    _cli("cap", "apply", str(caps))
    _cli("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000


@pytest.mark.parametrize("damaged", ["700 W", 700_000.0, 0, True])
def test_a_damaged_default_then_is_warned_of_and_the_old_limit_not_put_back(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: object
) -> None:
    """The caps unit capped GPU 0 at 450 W over an operator's 600 W; the driver was then
    reloaded, its new default 450 W on the GPU; the record's default then was hand-edited
    ("700 W"). It was passed over without a word: `cap reset --applied` put back the old
    driver's 600 W, above the GPU's default now, as if no reload was. Whether one was cannot be
    told: `cap show` warns of the key in one line, and the reset puts back the default now."""
    uuid = json.loads(_cli("gpu", "list", "--json"))[0]["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    _cli("cap", "apply", str(caps))
    record = tmp_path / "dvfs-state" / "caps-applied.json"
    data = json.loads(record.read_text())
    data[uuid]["power_limit_default_then_mw"] = damaged
    record.write_text(json.dumps(data, indent=2))
    monkeypatch.setitem(nvml.FAKE_PROFILES["h100-sxm"], "power_default_mw", 450_000)
    nvml.fake_update_device(0, power_limit_mw=450_000)  # the reloaded driver's default
    shown = CliRunner().invoke(cli, ["cap", "show"])
    assert shown.exit_code == 0, shown.output
    [line] = [x for x in shown.stderr.splitlines() if "power_limit_default_then_mw" in x]
    assert line.startswith(f"warning: dvfs's caps record {record} is damaged for GPU 0 "), line
    assert f"power_limit_default_then_mw is {json.dumps(damaged)}, expected " in line, line
    out = " ".join(_cli("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000, out
    assert "power limit 450 W (default: " in out and "power_limit_default_then_mw" in out, out


def test_a_partial_reset_drops_the_default_then_with_the_limit(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `cap reset` whose clock unlock NVML refused put the power limit back and dropped the
    entry's power_limit_mw and power_limit_before_mw, but kept power_limit_default_then_mw (the
    apply path drops all three). An older dvfs, which carries keys it does not know, then
    capped the GPU again after a driver reload: the stale default beside its new replaced
    limit read as a reload since that cap, and `cap reset --applied` put back the default, not
    the operator's limit that cap replaced."""
    uuid = json.loads(_cli("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=1200, power_limit_w=450.0),)))
    )
    _cli("cap", "apply", str(caps))
    nvml.fake_update_device(
        0, errors={"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NOT_SUPPORTED}
    )
    assert CliRunner().invoke(cli, ["cap", "reset", "0"]).exit_code == 1
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000
    record = tmp_path / "dvfs-state" / "caps-applied.json"
    data = json.loads(record.read_text())
    assert data[uuid]["power_limit_mw"] is None, data
    assert data[uuid].get("power_limit_default_then_mw") is None, data
    # the driver reloaded (its default 600 W), an operator's 500 W, then an older dvfs's 450 W
    # cap over it: that dvfs writes the limits it knows and carries the rest as they are
    nvml.fake_update_device(0, errors={})
    monkeypatch.setitem(nvml.FAKE_PROFILES["h100-sxm"], "power_default_mw", 600_000)
    nvml.fake_update_device(0, power_limit_mw=450_000)
    data[uuid].update(power_limit_mw=450_000, power_limit_before_mw=500_000)
    record.write_text(json.dumps(data, indent=2))
    out = " ".join(_cli("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000, out
