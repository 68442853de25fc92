"""The systemd unit that re-applies caps at boot: NVML must still reach the GPUs inside its
sandbox, on every systemd version it may meet."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "dvfs-caps.service"


def directives(section: str) -> list[tuple[str, str]]:
    """(key, value) pairs of one section, in order, repeated keys kept (systemd's syntax)."""
    pairs, current = [], None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        if current == section:
            pairs.append((key.strip(), value.strip()))
    return pairs


def values(key: str, section: str = "Service") -> list[str]:
    return [v for k, v in directives(section) if k == key]


def test_the_nvidia_device_nodes_are_allowed_alongside_protect_clock() -> None:
    """On systemd < 252, ProtectClock=yes adds `DeviceAllow=char-rtc r`, which makes the
    device policy an allow-list: without explicit entries every /dev/nvidia* node is blocked."""
    assert values("ProtectClock") == ["yes"]
    assert values("DevicePolicy") == ["closed"]
    allowed = {tuple(v.split()) for v in values("DeviceAllow")}
    for node in (
        "char-nvidia-frontend",  # major 195 (/dev/nvidiactl, /dev/nvidia<N>), proprietary module
        "char-nvidia",  # the same major as the open kernel module names it
        "char-nvidia-uvm",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ):
        assert (node, "rw") in allowed, node
    for spec, access in allowed:
        assert spec.startswith(("char-", "/dev/")) and set(access) <= set("rwm")
        if spec.startswith("/dev/"):
            assert not set(spec) & set("*?["), f"{spec}: globs work only in char-<group> form"
    assert values("PrivateDevices") in ([], ["no"])


def test_the_sandbox_keeps_what_nvml_needs_and_says_why() -> None:
    assert values("CapabilityBoundingSet") == ["CAP_SYS_ADMIN"]  # the driver's privilege check
    assert values("NoNewPrivileges") == ["yes"] and values("ProtectHome") == ["yes"]
    assert "ProcSubset" not in dict(directives("Service"))  # NVML reads /proc/driver/nvidia
    text = UNIT.read_text()
    assert "must not live under /home" in text  # ProtectHome hides a dvfs installed there
    for needed in (
        ("Type", "oneshot"),
        ("RemainAfterExit", "yes"),
        ("ExecStart", "/usr/local/bin/dvfs cap apply /etc/dvfs/caps.toml"),
        ("ExecStop", "/usr/local/bin/dvfs cap reset"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
    ):
        assert needed in directives("Service"), needed
    assert ("After", "nvidia-persistenced.service") in directives("Unit")
    assert ("Wants", "nvidia-persistenced.service") in directives("Unit")


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed on this machine",
)
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart's binary exists: point it at this environment's dvfs.
    dvfs_bin = Path(sys.executable).parent / "dvfs"
    assert dvfs_bin.exists(), "install the package (pip install -e .) so the dvfs script exists"
    copy = tmp_path / "dvfs-caps.service"
    copy.write_text(UNIT.read_text().replace("/usr/local/bin/dvfs", str(dvfs_bin)))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr  # no warnings (unknown keys, bad values)
