"""The systemd unit that re-applies caps at boot: NVML must still reach the GPUs inside its
sandbox, on every systemd version it may meet."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "dvfs-caps.service"


def directives(section: str, unit: Path = UNIT) -> list[tuple[str, str]]:
    """(key, value) pairs of one section of `unit`, in order, repeated keys kept (systemd's
    syntax)."""
    pairs, current = [], None
    for raw in unit.read_text().splitlines():
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
        ("ExecStart", "/usr/local/bin/dvfs cap apply /etc/dvfs/caps.toml --wait-for-driver 300"),
        ("ExecStop", "/usr/local/bin/dvfs cap reset --applied"),
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
@pytest.mark.parametrize("name", ["dvfs-caps", "dvfs-govern", "dvfs-monitor"])
def test_systemd_analyze_verifies_each_unit(tmp_path: Path, name: str) -> None:
    unit = UNIT.parent / f"{name}.service"
    # verify checks that ExecStart's binary exists: point it at this environment's dvfs.
    dvfs_bin = Path(sys.executable).parent / "dvfs"
    assert dvfs_bin.exists(), "install the package (pip install -e .) so the dvfs script exists"
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace("/usr/local/bin/dvfs", str(dvfs_bin)))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr  # no warnings (unknown keys, bad values)


def test_the_caps_units_stop_timeout_outlasts_its_reset_of_hung_gpus() -> None:
    """`cap reset --applied` (ExecStop) resets the GPUs side by side, GPUs whose driver hangs
    costing one deadline together (their later calls then fail at once), however many: one
    deadline for the GPUs' permission check and probe side by side (a GPU hung there is not
    reset), one for their MIG modes read side by side, one for the resets, and NVML's two
    starts, count and two shutdowns, each just inside its deadline: eight. One after another,
    eight hung GPUs took fourteen (the unit's 150 s); under systemd's default 90 s stop
    timeout, its SIGKILL came before the last GPUs were reset."""
    from dvfs.gpu.deadline import DEFAULT_DEADLINE_S

    stop_deadlines = 1 + 1 + 1 + 5
    [timeout] = values("TimeoutStopSec")
    assert int(timeout) > stop_deadlines * DEFAULT_DEADLINE_S, timeout
    readme = " ".join((UNIT.parent.parent / "README.md").read_text().split())
    said = f"take at most {stop_deadlines * DEFAULT_DEADLINE_S:g} s at the default "
    assert said + f"{DEFAULT_DEADLINE_S:g} s, on any number of GPUs" in readme
    assert f"`TimeoutStopSec` ({timeout} s)" in readme
    assert f"over {stop_deadlines} deadlines" in readme
    unit = " ".join(line.lstrip("# ") for line in UNIT.read_text().splitlines())
    assert f"inside this {timeout} s. A longer deadline needs this over {stop_deadlines}" in unit


# --------------------------------------------------------------------------- dvfs-govern.service

GOVERN = UNIT.parent / "dvfs-govern.service"


def test_the_governors_stop_timeout_outlasts_its_restore_at_the_default_deadline() -> None:
    """A stop puts the GPUs back side by side; on GPUs whose NVML calls each return just
    inside the deadline it waits out a call the signal left, then the clock's reset and the
    power limit's range, default and set, and NVML's shutdown at the exit: six deadlines. At
    60 s the unit's SIGKILL could land on the last of them (the README said three and 40 s)."""
    from dvfs.gpu.deadline import DEFAULT_DEADLINE_S

    stop_deadlines = 1 + 1 + 3 + 1
    [timeout] = [v for k, v in directives("Service", GOVERN) if k == "TimeoutStopSec"]
    assert int(timeout) > stop_deadlines * DEFAULT_DEADLINE_S, timeout
    readme = " ".join((UNIT.parent.parent / "README.md").read_text().split())
    said = f"{stop_deadlines * DEFAULT_DEADLINE_S:g} s at the default {DEFAULT_DEADLINE_S:g} s"
    assert said in readme and f"`TimeoutStopSec` ({timeout} s)" in readme


def govern_directives(section: str) -> list[tuple[str, str]]:
    """(key, value) pairs of one section of the governor's unit."""
    pairs, current = [], None
    for raw in GOVERN.read_text().splitlines():
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


def govern_values(key: str, section: str = "Service") -> list[str]:
    return [v for k, v in govern_directives(section) if k == key]


def test_the_governor_unit_restores_on_stop_and_after_a_crash() -> None:
    [start] = govern_values("ExecStart")
    assert start.startswith("/usr/local/bin/dvfs govern --plan /etc/dvfs/govern-plan.toml")
    assert "--dry-run" not in start and "--listen 127.0.0.1:" in start
    # SIGTERM makes dvfs restore and exit 143: a clean stop; after SIGKILL or a crash the state
    # files remain and ExecStopPost puts them back.
    assert govern_values("KillSignal") == ["SIGTERM"]
    assert govern_values("SuccessExitStatus") == ["143"]
    assert govern_values("ExecStopPost") == ["/usr/local/bin/dvfs gpu reset"]
    assert govern_values("Restart") == ["on-failure"]
    assert set(govern_values("RestartPreventExitStatus")[0].split()) == {"2", "3", "4"}
    assert ("ConditionPathExists", "/etc/dvfs/govern-plan.toml") in govern_directives("Unit")
    assert "dvfs-caps.service" in " ".join(govern_values("After", "Unit"))
    # A failure that keeps exiting 1 must end in a failed unit, not restarts for ever: the
    # limit's window must outlast the restarts it counts (systemd's default, 10 s, never does).
    [window] = govern_values("StartLimitIntervalSec", "Unit")
    [burst] = govern_values("StartLimitBurst", "Unit")
    [pause] = govern_values("RestartSec")
    assert int(burst) >= 2 and int(window) > int(burst) * int(pause)


def test_the_governor_unit_reaches_loopback_and_the_gpus_only() -> None:
    service = dict(govern_directives("Service"))
    assert "PrivateNetwork" not in service  # it would hide the server's loopback port
    assert govern_values("IPAddressAllow") == ["localhost"]
    assert govern_values("IPAddressDeny") == ["any"]
    assert set(govern_values("RestrictAddressFamilies")[0].split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
    }
    # The GPU side is the caps unit's, line for line.
    for key in (
        "CapabilityBoundingSet",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "ProtectHome",
        "ProtectSystem",
        "SystemCallFilter",
        "Environment",
        "StateDirectory",
    ):
        caps_side = values(key)
        if key == "Environment":
            caps_side = [v for v in caps_side if not v.startswith("PYTHONUNBUFFERED")]
            governed = [v for v in govern_values(key) if not v.startswith("PYTHONUNBUFFERED")]
        else:
            governed = govern_values(key)
        assert governed == caps_side, key
    assert "must not live under /home" in GOVERN.read_text()


def test_each_units_readme_reference_names_a_readme_section() -> None:
    """An operator installing a unit follows its `see README ("Section")` to that heading."""
    headings = {
        line.lstrip("#").strip()
        for line in (UNIT.parent.parent / "README.md").read_text().splitlines()
        if line.startswith("#")
    }
    for unit in sorted(UNIT.parent.glob("*.service")):
        named = re.findall(r'README \("([^"]+)"\)', unit.read_text())
        assert named, unit.name
        for section in named:
            assert section in headings, f"{unit.name} names README section {section!r}"


# -------------------------------------------------------------------------- dvfs-monitor.service

MONITOR = UNIT.parent / "dvfs-monitor.service"


def unit_values(unit: Path, key: str, section: str = "Service") -> list[str]:
    """The values of `key` in one section of `unit`, in order (repeated keys kept)."""
    return [value for name, value in directives(section, unit) if name == key]


def listen_of(unit: Path) -> str:
    [start] = unit_values(unit, "ExecStart")
    argv = start.split()
    return argv[argv.index("--listen") + 1]


def test_the_monitor_unit_listens_where_the_governor_does_not() -> None:
    """dvfs monitor runs beside dvfs govern: each unit serves its metrics on its command's
    default port, and the two differ, so neither unit (nor either command run by hand with its
    defaults beside the other's unit) finds its port taken."""
    from dvfs.cli.govern import govern, monitor

    def default_listen(command: Any) -> str:
        [option] = [p for p in command.params if p.name == "listen"]
        return str(option.default)

    assert listen_of(GOVERN) == default_listen(govern)
    assert listen_of(MONITOR) == default_listen(monitor)
    assert default_listen(monitor) != default_listen(govern)
    [start] = unit_values(MONITOR, "ExecStart")
    assert start.startswith("/usr/local/bin/dvfs monitor --url http://127.0.0.1:30000")
    assert "9436" in MONITOR.read_text().split("[Unit]")[0]  # its comment names its port


def test_the_monitor_unit_reads_only() -> None:
    """No capability (reading NVML needs none), no state directory of its own (it would take
    /var/lib/dvfs from the units that write it) and nothing to restore; the GPU and network
    side as the other units'."""
    assert unit_values(MONITOR, "CapabilityBoundingSet") == [""]
    for key in ("StateDirectory", "ExecStopPost", "ExecStop", "AmbientCapabilities"):
        assert unit_values(MONITOR, key) == [], key
    assert unit_values(MONITOR, "ProtectSystem") == ["strict"]
    assert unit_values(MONITOR, "Restart") == ["on-failure"]
    assert unit_values(MONITOR, "RestartPreventExitStatus") == ["2"]
    [window] = unit_values(MONITOR, "StartLimitIntervalSec", "Unit")
    [burst] = unit_values(MONITOR, "StartLimitBurst", "Unit")
    [pause] = unit_values(MONITOR, "RestartSec")
    assert int(burst) >= 2 and int(window) > int(burst) * int(pause)
    for key in ("DevicePolicy", "DeviceAllow", "ProtectClock", "ProtectHome", "SystemCallFilter"):
        assert unit_values(MONITOR, key) == values(key), key
    for key in ("RestrictAddressFamilies", "IPAddressAllow", "IPAddressDeny", "Environment"):
        assert unit_values(MONITOR, key) == govern_values(key), key
    assert "must not live under /home" in MONITOR.read_text()


def _has_published(log: Path) -> bool:
    """Whether the monitor writing `log` serves a page with a GPU's reading yet."""
    import urllib.request

    found = re.search(r"serving metrics on (\S+)", log.read_text())
    if found is None:
        return False
    try:
        with urllib.request.urlopen(found.group(1), timeout=5) as page:
            return "dvfs_gpu_power_watts{" in page.read().decode()
    except OSError:
        return False


def test_stopping_the_monitor_unit_is_a_clean_stop(tmp_path: Path) -> None:
    """`systemctl stop` (and a shutdown) sends SIGTERM; dvfs monitor catches it and exits 143,
    an exit code, which systemd counts as a failure unless SuccessExitStatus lists it (only a
    death by the signal itself is clean by default): every stop would leave the unit failed,
    for alerting on failed units to page. The code is the command's own, read by stopping it."""
    import signal
    import time

    from nvml_support import fake_env

    assert unit_values(MONITOR, "KillSignal") in ([], ["SIGTERM"])
    log = tmp_path / "monitor.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", "monitor", "--interval", "0.05"]
            + ["--listen", "127.0.0.1:0"],
            env=fake_env(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Stopped once its loop runs, as systemd stops a started unit: its first page of GPU
        # readings is published inside the loop, after its signal handlers are set ("serving
        # metrics" is said before them, where a SIGTERM would kill it by the signal itself).
        deadline = time.monotonic() + 60  # only so that a hang ends
        while not _has_published(log) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert code > 0, log.read_text()  # exited with a code, not killed by the signal
    clean = " ".join(unit_values(MONITOR, "SuccessExitStatus")).split()
    assert str(code) in clean, f"dvfs monitor exits {code} on SIGTERM; the unit counts {clean}"


def test_the_readme_says_how_to_remove_the_caps_a_failed_start_applied() -> None:
    """`cap apply` exits 1 (a GPU fallen off the bus) or 5 (UUIDs not here) having capped the
    GPUs it could, which fails the oneshot unit; systemd runs `ExecStop` only after a
    successful start, so `systemctl stop` then resets nothing. The README said only that
    `ExecStop` resets, and its exit codes gave `cap apply` 5 or 0 where a lost GPU makes it 1:
    it now says how the caps of a failed start are removed, and the lost GPU's exit."""
    assert values("ExecStop") == ["/usr/local/bin/dvfs cap reset --applied"]
    assert values("ExecStopPost") == []  # it would reset the caps of every failed start
    readme = " ".join((UNIT.parent.parent / "README.md").read_text().split())
    assert "A failed start runs no `ExecStop`" in readme
    assert "`systemctl stop dvfs-caps` then leaves the caps it applied in place" in readme
    assert "`sudo dvfs cap reset --applied` removes them" in readme
    codes = readme[readme.index("Exit codes: - 0: success") :]
    codes = codes[: codes.index("interrupted")]
    assert "1, either way, when a GPU has fallen off the bus" in codes, codes


def test_the_caps_units_exit_codes_are_each_said() -> None:
    """The comment above ExecStart said what exits 2, 5 and 1 mean, then called 2, 3, 4 and 5
    refusals: 3 (another dvfs holds a GPU, or a GPU holds unrestored changes) and 4 (a GPU NVML
    counts but the service may not talk to), which `cap apply` exits with too, were said
    nowhere. Each code the comment calls a refusal, and each `cap apply` documents, is said."""
    text = UNIT.read_text()
    block = text[text.index("[Service]") : text.index("\nExecStart=")]
    comment = " ".join(line.lstrip("# ") for line in block.splitlines() if line.startswith("#"))
    said = set(re.findall(r"(?:Exit |; )(\d):", comment))
    [refusals] = re.findall(r"a refusal \(([\d, ]+)\)", comment)
    assert set(refusals.split(", ")) <= said, (refusals, said)
    from dvfs.cli.cap import apply

    documented = set(re.findall(r"\b([1-5])\b", " ".join((apply.help or "").split())))
    assert documented <= said, (documented, said)


def test_the_caps_unit_waits_for_a_driver_not_loaded_yet_on_every_systemd() -> None:
    """At boot the NVIDIA driver may not be loaded yet (a DKMS build, no nvidia-persistenced
    to order after). The unit retried with Restart=on-failure, which systemd before 244
    refuses on a oneshot unit (RHEL 8 has 239): the unit did not load at all. `cap apply`
    waits for the driver itself (bounded), under a start timeout above the wait (a oneshot
    unit has none by default), and the unit has no Restart= nor start limits."""
    assert values("Type") == ["oneshot"]
    assert values("After", "Unit") == ["nvidia-persistenced.service"]
    assert values("Wants", "Unit") == ["nvidia-persistenced.service"]
    for key in ("Restart", "RestartSec", "RestartPreventExitStatus"):
        assert values(key) == [], key
    for key in ("StartLimitIntervalSec", "StartLimitBurst"):
        assert values(key, "Unit") == [], key
    [start] = values("ExecStart")
    argv = start.split()
    wait_s = int(argv[argv.index("--wait-for-driver") + 1])
    assert wait_s >= 60, "a late driver (a DKMS build) gets minutes, not seconds"
    [timeout] = values("TimeoutStartSec")
    assert int(timeout) > wait_s + 60, (timeout, wait_s)  # the wait, then the apply itself
    readme = " ".join((UNIT.parent.parent / "README.md").read_text().split())
    assert f"its `cap apply --wait-for-driver {wait_s}` tries NVML again" in readme
    assert f"`TimeoutStartSec={timeout}` bounds the start" in readme
    assert "reset-failed dvfs-caps" not in readme  # no start limit to clear any more


def test_protect_home_is_said_to_hide_the_python_a_venv_was_made_from_too() -> None:
    """The README and the units said only that a dvfs (a venv) under /home, /root or /run/user
    is hidden by ProtectHome; a venv in /opt made from a pyenv Python under /root links to it
    (bin/python, pyvenv.cfg's home), hidden too, and the unit failed to start though the note
    was followed. Each now says so, with what to check."""
    readme = " ".join((UNIT.parent.parent / "README.md").read_text().split())
    assert "nor the Python its virtualenv was made from" in readme
    assert "`readlink -f /opt/dvfs/bin/python` must print a path outside those three" in readme
    block = readme[readme.index("sudo python3 -m venv /opt/dvfs") :]
    assert block.index("readlink -f /opt/dvfs/bin/python") < block.index("enable --now")
    for unit in sorted(UNIT.parent.glob("*.service")):
        text = " ".join(line.lstrip("# ") for line in unit.read_text().splitlines())
        text = " ".join(text.split())
        assert "nor the Python its venv was made from" in text, unit.name
        assert "`readlink -f /opt/dvfs/bin/python` must print a path outside them" in text, unit


# ------------------------------------------------------------------ every unit's dvfs commands

EXEC_KEYS = ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecStop", "ExecStopPost", "ExecReload")


@pytest.mark.parametrize("unit", sorted(UNIT.parent.glob("*.service")), ids=lambda p: p.name)
def test_each_units_dvfs_commands_parse_as_the_cli_spells_them(unit: Path) -> None:
    """Every command a unit runs is a dvfs command, and each option it passes is one that
    command's --help lists, spelled as there and taking the values given (a renamed option
    or subcommand fails the unit at boot, where nothing but the journal shows it)."""
    import shlex

    import click

    from dvfs.cli import cli

    commands = [v for k, v in directives("Service", unit) if k in EXEC_KEYS]
    assert commands, unit.name
    for line in commands:
        argv = shlex.split(line.lstrip("-@:+!"))
        assert argv[0] == "/usr/local/bin/dvfs", line
        words, command = list(argv[1:]), cli
        path: list[str] = []
        while isinstance(command, click.Group):
            asked = words[0] if words else ""
            name, found, words = command.resolve_command(
                command.make_context("dvfs", list(words), resilient_parsing=True), words
            )
            assert found is not None and name, f"{unit.name}: {line}: no command {asked!r}"
            path.append(name)
            command = found
        ctx = command.make_context(" ".join(["dvfs", *path]), list(words))  # raises if bad
        helped = command.get_help(ctx)
        for word in words:
            if word.startswith("--"):
                assert word.split("=")[0] in helped, f"{unit.name}: {line}: {word}"


@pytest.mark.parametrize("unit", ["dvfs-govern.service", "dvfs-monitor.service"])
def test_a_unit_whose_driver_never_loads_ends_failed(unit: str) -> None:
    """The governor (and monitor) unit whose NVIDIA driver never loads waits --wait-for-driver
    300 s each start, exits 1 and restarts RestartSec later: a start every 310 s, of which a
    600 s start-limit window held two, never five, so it restarted for ever, never failed for
    alerting to see. The window holds StartLimitBurst such starts (the next is refused: the
    unit is failed), and the README gives the window and when it fails."""
    path = UNIT.parent / unit
    [start] = unit_values(path, "ExecStart")
    argv = start.split()
    wait_s = int(argv[argv.index("--wait-for-driver") + 1])
    [window] = unit_values(path, "StartLimitIntervalSec", "Unit")
    [burst] = unit_values(path, "StartLimitBurst", "Unit")
    [pause] = unit_values(path, "RestartSec")
    every = wait_s + int(pause)  # one start's wait and exit, then the pause before the next
    # systemd refuses the start after `burst` starts within `window` of the first
    assert int(burst) * every < int(window), (burst, every, window)
    readme = " ".join((UNIT.parent.parent / "README.md").read_text().split())
    minutes = int(window) // 60
    said = {30: "thirty"}.get(minutes, str(minutes))
    assert f"five failed starts in {said} minutes leave it failed" in readme
    assert f"the unit starts every {every} s" in readme
    assert f"some {round(int(burst) * every / 60)} minutes after boot" in readme
