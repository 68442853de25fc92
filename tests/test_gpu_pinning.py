"""The started server runs on the metered GPUs: NVML's compute processes of every GPU, matched
against the server's process tree, through `dvfs sweep` with the fake NVML and the stub."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from nvml_support import dvfs_in_process, fake_env, fresh_fake
from sglang_support import running, stub_campaign

import dvfs
from dvfs.engines.sglang import pinning_outcome
from dvfs.errors import EngineError
from dvfs.gpu.base import GpuProcesses
from dvfs.gpu.nvml import gpu_processes, open_nvml_gpus
from dvfs.procfs import server_pids
from dvfs.records.session import Server

ONE_DRAFTER = '\n[drafters.none]\nalgorithm = "none"\n'
DEVICES = "h100-sxm,h100-sxm,h100-sxm"
LIST_FN = "nvmlDeviceGetComputeRunningProcesses"
MEMORY_FN = "nvmlDeviceGetMemoryInfo"


@pytest.fixture
def nv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake pynvml on a fresh three-GPU state in `tmp_path` (this process and the sweep's)."""
    return fresh_fake(tmp_path, monkeypatch, DEVICES)


def _no_process_lists(nv: ModuleType, memory: bool = False) -> None:
    """NVML lists no compute processes on any of the fake's GPUs (Not Supported), nor, unless
    `memory`, reads their memory: where the server took it cannot tell either."""
    errors = {LIST_FN: nv.NVML_ERROR_NOT_SUPPORTED}
    if not memory:
        errors[MEMORY_FN] = nv.NVML_ERROR_NOT_SUPPORTED
    for index in range(3):
        nv.fake_update_device(index, errors=errors)


def _sweep_into(path: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`dvfs sweep PATH --out OUT --no-progress` with ENV, in this process."""
    return dvfs_in_process("sweep", str(path), "--out", str(out), "--no-progress", env=env)


def _journal(out: Path) -> list[dict]:
    """The records of the journal in `out`."""
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def _doctor(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`dvfs doctor PATH --out <PATH's folder>/o` with ENV, in this process."""
    return dvfs_in_process("doctor", str(path), "--out", str(path.parent / "o"), env=env)


def _refused(checked: subprocess.CompletedProcess[str], line: str) -> None:
    """Doctor failed (exit 1) with `line`, its wrapping undone."""
    assert checked.returncode == 1, checked.stdout
    assert line in " ".join(checked.stdout.split()), checked.stdout


def _server_gpus_line(checked: subprocess.CompletedProcess) -> str:
    """Doctor's one "server GPUs" line."""
    [line] = [x for x in checked.stdout.splitlines() if "server GPUs" in x]
    return line


def _unwrapped(text: str) -> str:
    """`text` without spaces: doctor wraps its lines to the console's width, a long path
    (a temporary folder's, longer under xdist) mid-word too."""
    return "".join(text.split())


def _doctor_warns(path: Path, env: dict[str, str]) -> str:
    """Doctor's output on one line (`_doctor`), its "server GPUs" line a warning that does not
    say the server is pinned."""
    checked = _doctor(path, env)
    line = _server_gpus_line(checked)
    assert line.startswith("warn server GPUs: "), checked.stdout
    output = " ".join(checked.stdout.split())
    assert "pinned to" not in output, output
    return output


def _swept_server(path: Path, out: Path, env: dict[str, str]) -> dict:
    """The one server record of a sweep of `path` into `out` (`_sweep_into`) that exits 0."""
    swept = _sweep_into(path, out, env)
    assert swept.returncode == 0, swept.stderr
    [server] = [r for r in _journal(out) if r["type"] == "server"]
    return server


def _sweep(tmp_path: Path, stub: dict | None = None) -> tuple[int, list[dict], list[dict], str]:
    """One drafter's sweep on GPU 1: exit code, cell records, server records, output."""
    path, marker = stub_campaign(
        tmp_path,
        stub=stub,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        gpu='backend = "nvml"\ndevices = [1]',
    )
    out = tmp_path / "out"
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    result = _sweep_into(path, out, env)
    records = _journal(out)
    assert running(marker) == []  # every server was stopped, the refused one too
    cells = [r for r in records if r["type"] == "cell"]
    servers = [r for r in records if r["type"] == "server"]
    return result.returncode, cells, servers, result.stdout + result.stderr


def _tp2_campaign(tmp_path: Path) -> Path:
    """The fake-NVML campaign with one tensor-parallel server on GPUs 0 and 1 (`tp2.toml`)."""
    from nvml_support import NVML_CAMPAIGN

    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    text = text.replace("devices = [0]", "devices = [0, 1]").replace(
        'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2'
    )
    path = tmp_path / "tp2.toml"
    path.write_text(text)
    return path


def _pinning(tmp_path: Path) -> dict[str, str]:
    return json.loads(dvfs.open_cube(str(tmp_path / "out" / "cube.nc")).attrs["gpu_pinning"])


# -- end to end ----------------------------------------------------------------------------------


def test_a_server_on_the_metered_gpu_is_verified_in_the_cube(
    nv: ModuleType, tmp_path: Path
) -> None:
    code, cells, servers, output = _sweep(tmp_path)
    assert code == 0, output
    assert cells and all(c["status"] == "ok" for c in cells)
    uuid = nv.fake_state()["devices"][1]["uuid"]
    [server] = servers
    assert server["gpu_pinning"] == f"verified: GPU 1 ({uuid})"
    assert _pinning(tmp_path) == {"none": f"verified: GPU 1 ({uuid})"}
    # The stub dropped itself from the fake GPU when it was stopped.
    assert all(not d["processes"] for d in nv.fake_state()["devices"])


def test_a_server_on_another_gpu_fails_its_cells_with_one_line(
    nv: ModuleType, tmp_path: Path
) -> None:
    code, cells, servers, output = _sweep(tmp_path, stub={"nvml_device": 0})
    assert code == 5, output
    assert servers == []  # a refused server is never recorded as having served
    assert cells and all(c["status"] == "failed" for c in cells)
    uuid = nv.fake_state()["devices"][0]["uuid"]
    for cell in cells:
        error = cell["error"]
        assert "\n" not in error
        assert f"GPU 0 ({uuid})" in error and "does not meter" in error
        assert "CUDA_VISIBLE_DEVICES" in error and "server_command" in error


def on_gpu_1(tmp_path: Path) -> tuple[Path, Path]:
    """A one-cell stub campaign on the fake's GPU 1, observe-only: (campaign, marker)."""
    return stub_campaign(
        tmp_path,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs='sm_clock = "stock"\nsettle_s = 0.0',
        gpu='backend = "nvml"\ndevices = [1]\nactuation = "off"',
    )


def test_doctor_fails_a_campaign_env_pinning_the_server_to_another_gpu(
    nv: ModuleType, tmp_path: Path
) -> None:
    """engine.sglang.env.CUDA_VISIBLE_DEVICES naming another GPU's UUID than gpu.devices (by
    index, so the loader cannot tell): the sweep refuses every server, each cell failing, so
    doctor fails it too (exit 1), in the sweep's words."""
    other = nv.fake_state()["devices"][0]["uuid"]
    path, marker = on_gpu_1(tmp_path)
    path.write_text(
        path.read_text().replace("env = { ", f'env = {{ CUDA_VISIBLE_DEVICES = "{other}", ')
    )
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    checked = dvfs_in_process("doctor", str(path), "--out", str(tmp_path / "c"), env=env)
    swept = dvfs_in_process(
        "sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress", env=env
    )
    assert running(marker) == []
    assert swept.returncode == 5
    assert checked.returncode == 1, checked.stdout
    said = f"engine.sglang.env.CUDA_VISIBLE_DEVICES = '{other}' contradicts gpu.devices"
    [failed] = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert failed.startswith("FAIL server GPUs:")
    assert said in " ".join(checked.stdout.split())
    assert said in " ".join((swept.stdout + swept.stderr).split())


def test_a_campaign_env_naming_the_metered_gpu_by_a_short_uuid_passes(
    nv: ModuleType, tmp_path: Path
) -> None:
    """engine.sglang.env.CUDA_VISIBLE_DEVICES naming the metered GPU by the start of its UUID
    (`GPU-8932f937`, which CUDA takes for the one GPU it begins) names no other GPU: doctor
    passes it (gpu.devices by index, checked at start), and so does the campaign's loader
    (gpu.devices by UUID); another GPU's short UUID still fails both."""
    devices = nv.fake_state()["devices"]
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered, other = devices[1]["uuid"], devices[0]["uuid"]
    for value, device, where in (
        (metered[:12], "1", "index"),
        (metered[:12].upper(), f'"{metered}"', "uuid"),
        (other[:12], "1", "other-index"),
        (other[:12], f'"{metered}"', "other-uuid"),
    ):
        folder = tmp_path / where
        path = observed_campaign(folder, devices=f"[{device}]")
        text = path.read_text()
        path.write_text(text.replace("env = { ", f'env = {{ CUDA_VISIBLE_DEVICES = "{value}", '))
        checked = dvfs_in_process("doctor", str(path), "--out", str(folder / "out"), env=env)
        said = f"CUDA_VISIBLE_DEVICES = '{value}' contradicts gpu.devices"
        output = " ".join((checked.stdout + checked.stderr).split())
        if where.startswith("other"):
            assert checked.returncode in (1, 2) and said in output, output
        else:
            assert checked.returncode == 0 and "contradicts" not in output, output
            assert f"ok server GPUs: the server is pinned to {metered}" in output


def observed_campaign(folder: Path, wrapper: tuple[str, ...] = (), devices: str = "[1]") -> Path:
    """A one-cell stub campaign in `folder` (made) metering `devices` observe-only, its
    server_command behind `wrapper`."""
    folder.mkdir(exist_ok=True)
    path, _ = stub_campaign(
        folder,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs='sm_clock = "stock"\nsettle_s = 0.0',
        gpu=f'backend = "nvml"\ndevices = {devices}\nactuation = "off"',
        wrapper=wrapper,
    )
    return path


def wrapped_campaign(folder: Path, visible: str, devices: str = "[1]") -> Path:
    """A one-cell stub campaign in `folder` (made) metering `devices` observe-only, its
    server_command wrapped in `env CUDA_VISIBLE_DEVICES=<visible>` (one argument to env)."""
    return observed_campaign(folder, ("env", f"CUDA_VISIBLE_DEVICES={visible}"), devices)


def test_a_server_command_wrapper_pinning_the_server_to_another_gpu_is_refused(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`env CUDA_VISIBLE_DEVICES=<another GPU's UUID>` in server_command replaces the UUIDs dvfs
    hands the wrapper: where NVML lists no processes nothing at start would see the server on
    the other GPU, and the metered GPU would measure an idle GPU's energy. The sweep refuses
    every server, and doctor fails it, in the sweep's words; the metered GPU's own UUID, or an
    index (a container's own numbering), passes."""
    _no_process_lists(nv)
    devices = nv.fake_state()["devices"]
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)

    def campaign(value: str, where: str) -> Path:
        return wrapped_campaign(tmp_path / where, value)

    other = campaign(devices[0]["uuid"], "other")
    checked = dvfs_in_process("doctor", str(other), "--out", str(tmp_path / "c"), env=env)
    out = tmp_path / "out"
    swept = _sweep_into(other, out, env)
    said = (
        f"engine.sglang.server_command sets CUDA_VISIBLE_DEVICES={devices[0]['uuid']}, other "
        f"GPUs than the metered {devices[1]['uuid']}"
    )
    assert checked.returncode == 1, checked.stdout
    [failed] = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert failed.startswith("FAIL server GPUs:")
    assert said in " ".join(checked.stdout.split())
    assert swept.returncode == 5, swept.stderr
    records = _journal(out)
    assert not [r for r in records if r["type"] == "server"]
    [cell] = [r for r in records if r["type"] == "cell"]
    assert cell["status"] == "failed" and said in cell["error"]
    for value, where in ((devices[1]["uuid"].upper(), "same"), ("0", "index")):
        fine = campaign(value, where)
        checked = dvfs_in_process("doctor", str(fine), "--out", str(tmp_path / where), env=env)
        assert "FAIL server GPUs" not in checked.stdout, checked.stdout


def test_a_server_command_wrapper_naming_the_metered_gpu_by_a_short_uuid_passes(
    nv: ModuleType, tmp_path: Path
) -> None:
    """CUDA takes the start of a UUID (`GPU-8932f937`) for the one GPU it begins: a wrapper's
    `env CUDA_VISIBLE_DEVICES=<the metered GPU's short UUID>` runs the server on the metered
    GPU, and is not refused as another GPU; the short UUID of another GPU still is, as the
    sweep starts it (its only cell failing, naming it)."""
    devices = nv.fake_state()["devices"]
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)

    def campaign(value: str, where: str) -> Path:
        return wrapped_campaign(tmp_path / where, value)

    for value, where in ((devices[1]["uuid"][:12], "short"), (devices[1]["uuid"][:8], "shorter")):
        fine = campaign(value.upper(), where)
        checked = dvfs_in_process("doctor", str(fine), "--out", str(tmp_path / where), env=env)
        pinned = f"ok   server GPUs: the server is pinned to {devices[1]['uuid']}"
        assert pinned in checked.stdout, checked.stdout
    short = devices[0]["uuid"][:12]
    other = campaign(short, "other")
    out = tmp_path / "out"
    swept = _sweep_into(other, out, env)
    assert swept.returncode == 5, swept.stderr
    records = _journal(out)
    [cell] = [r for r in records if r["type"] == "cell"]
    said = f"sets CUDA_VISIBLE_DEVICES={short}, other GPUs than the metered {devices[1]['uuid']}"
    assert cell["status"] == "failed" and said in cell["error"]


def test_doctor_warns_of_a_server_command_wrapper_setting_an_index(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`env CUDA_VISIBLE_DEVICES=0` in server_command replaces the UUIDs dvfs hands the
    wrapper, and an index is not judged (a container counts its own GPUs): doctor does not say
    the server is pinned to the metered GPU, it warns, naming the value, as it does for a list
    mixing a UUID and an index."""
    devices = nv.fake_state()["devices"]
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = devices[1]["uuid"]
    for value, where in (("0", "index"), (f"{metered},0", "mixed")):
        path = wrapped_campaign(tmp_path / where, value)
        checked = dvfs_in_process(
            "doctor", str(path), "--out", str(tmp_path / f"{where}-out"), env=env
        )
        line = _server_gpus_line(checked)
        assert line.startswith("warn server GPUs: "), checked.stdout
        said = f"sets CUDA_VISIBLE_DEVICES={value} in place of the metered {metered}"
        assert said in " ".join(checked.stdout.split()) and "pinned to" not in checked.stdout


def test_an_unverified_pinning_names_a_server_command_wrapper_setting_an_index(
    nv: ModuleType, tmp_path: Path
) -> None:
    """Where NVML cannot list processes, a wrapper's `env CUDA_VISIBLE_DEVICES=0` (an index,
    not checked) leaves where the server runs unknown twice over: the sweep's pinning outcome,
    kept in the journal (and the cube), says the wrapper set it, not only what NVML lacks."""
    _no_process_lists(nv)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    path = wrapped_campaign(tmp_path, "0")
    server = _swept_server(path, tmp_path / "out", env)
    assert server["gpu_pinning"].startswith("unverified: NVML cannot list")
    assert server["gpu_pinning"].endswith(
        "; engine.sglang.server_command sets CUDA_VISIBLE_DEVICES=0 in place of the metered "
        "GPUs' UUIDs, an index dvfs cannot check"
    )


def test_a_server_command_wrapper_listing_the_metered_gpus_with_spaces_is_read_whole(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`env "CUDA_VISIBLE_DEVICES=GPU-a, GPU-b"` (a comma list written with spaces, one
    argument to env) sets the whole list, which CUDA reads as dvfs does (entries stripped): a
    tensor-parallel server's two metered GPUs pass, rather than being cut at the space (the
    first GPU alone, refused as other GPUs), and a list adding an index is warned of."""
    devices = nv.fake_state()["devices"]
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    a, b = devices[1]["uuid"], devices[2]["uuid"]
    for value, where, said in (
        (f"{a}, {b}", "both", f"ok server GPUs: the server is pinned to {a},{b}"),
        (f"{a}, 0", "index", f"sets CUDA_VISIBLE_DEVICES={a},0 in place of the metered {a},{b}"),
    ):
        path = wrapped_campaign(tmp_path / where, value, devices="[1, 2]")
        path.write_text(
            path.read_text().replace('backend = "sglang"', 'backend = "sglang"\ntp_size = 2')
        )
        checked = dvfs_in_process(
            "doctor", str(path), "--out", str(tmp_path / f"{where}-out"), env=env
        )
        assert "FAIL server GPUs" not in checked.stdout, checked.stdout
        assert said in " ".join(checked.stdout.split()), checked.stdout


#: A stand-in `docker`: a container sees the GPUs `--gpus device=...` names (the stub runs with
#: CUDA_VISIBLE_DEVICES set to them), none of the CUDA_VISIBLE_DEVICES dvfs hands it unless
#: passed it (`-e CUDA_VISIBLE_DEVICES`, podman's `--env-host`); it runs what follows the image
#: name IMG.
FAKE_DOCKER = """#!/bin/sh
visible=
passed=
while [ "$#" -gt 0 ] && [ "$1" != IMG ]; do
  if [ "$1" = --gpus ]; then shift; visible=$(echo "$1" | tr -d '"' | sed -n 's/^device=//p'); fi
  if [ "$1" = --env-host ]; then passed=1; fi
  if [ "$1" = -e ] && [ "$2" = CUDA_VISIBLE_DEVICES ]; then passed=1; fi
  shift
done
shift
if [ -n "$passed" ]; then visible=$CUDA_VISIBLE_DEVICES; fi
exec env CUDA_VISIBLE_DEVICES="$visible" "$@"
"""


def container_campaign(
    folder: Path,
    *flags: str,
    before: tuple[str, ...] = (),
    engine: str = "docker",
    run: tuple[str, ...] = ("run",),
    inside: tuple[str, ...] = (),
) -> Path:
    """A one-cell stub campaign in `folder` (made) metering GPU 1 observe-only, its server
    started by the stand-in docker (`FAKE_DOCKER`) named `engine`: `[*before, engine, *run,
    *flags, IMG, *inside]`."""
    folder.mkdir()
    docker = folder / engine
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    return observed_campaign(folder, (*before, str(docker), *run, *flags, "IMG", *inside))


def test_a_container_given_another_gpu_by_uuid_is_refused(nv: ModuleType, tmp_path: Path) -> None:
    """A container does not inherit the CUDA_VISIBLE_DEVICES dvfs hands `docker run`: it sees
    the GPUs `--gpus device=...`, podman's `--device nvidia.com/gpu=...` or the
    NVIDIA_VISIBLE_DEVICES the NVIDIA runtime reads give it. Naming another GPU by UUID (its
    start too), dvfs passed it ("pinned to" the metered GPU), and the sweep measured the idle
    metered GPU while the server ran on the other one, where NVML could not list processes
    (a container's never are the started process's). Doctor fails it, and the sweep refuses
    the server before it starts, in the same line; the metered GPU's own UUID passes, pinned
    by the container's setting (and by CUDA_VISIBLE_DEVICES only where it is passed that)."""
    _no_process_lists(nv)
    devices = nv.fake_state()["devices"]
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = devices[0]["uuid"], devices[1]["uuid"]
    cases = [
        (("--gpus", f"device={other}"), (), f"--gpus device={other}"),
        (("--gpus", f'"device={metered},{other}"'), (), f'--gpus "device={metered},{other}"'),
        ((f"--gpus=device={other[:12]}",), (), f"--gpus device={other[:12]}"),
        (("--device", f"nvidia.com/gpu={other}"), (), f"--device nvidia.com/gpu={other}"),
        (("-e", f"NVIDIA_VISIBLE_DEVICES={other}"), (), f"NVIDIA_VISIBLE_DEVICES={other}"),
        ((f"--env=NVIDIA_VISIBLE_DEVICES={other}",), (), f"NVIDIA_VISIBLE_DEVICES={other}"),
        (
            ("-e", "NVIDIA_VISIBLE_DEVICES"),
            ("env", f"NVIDIA_VISIBLE_DEVICES={other}"),
            f"NVIDIA_VISIBLE_DEVICES={other}",
        ),
    ]
    for number, (flags, before, setting) in enumerate(cases):
        path = container_campaign(tmp_path / f"c{number}", *flags, before=before)
        checked = _doctor(path, env)
        said = (
            f"engine.sglang.server_command gives its container {setting}, other GPUs than the "
            f"metered {metered}: the server would run where dvfs does not meter; give it the "
            f"metered GPU(s) by UUID instead ({metered}), or pass the container dvfs's own "
            "CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES with --gpus all), right for each "
            "fleet worker's GPUs"
        )
        assert checked.returncode == 1, checked.stdout
        [failed] = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
        assert failed.startswith("FAIL server GPUs:")
        assert said in " ".join(checked.stdout.split()), checked.stdout
    out = tmp_path / "out"
    swept = _sweep_into(path, out, env)
    assert swept.returncode == 5, swept.stderr
    records = _journal(out)
    assert not [r for r in records if r["type"] == "server"]
    assert not (out / "logs").exists()  # no server was started
    [cell] = [r for r in records if r["type"] == "cell"]
    assert cell["status"] == "failed" and said in cell["error"]
    # Pinned by the container's GPUs alone: it never receives CUDA_VISIBLE_DEVICES (the ok line
    # said "CUDA_VISIBLE_DEVICES; the container's ..."), unless passed it.
    for number, (flags, by) in enumerate(
        (
            (("--gpus", f"device={metered[:12].upper()}"), f"--gpus device={metered[:12].upper()}"),
            (("--gpus", f'"device={metered}"'), f'--gpus "device={metered}"'),
            (("-e", f"NVIDIA_VISIBLE_DEVICES={metered}"), f"NVIDIA_VISIBLE_DEVICES={metered}"),
            (
                ("--gpus", f"device={metered}", "-e", "CUDA_VISIBLE_DEVICES"),
                f"CUDA_VISIBLE_DEVICES; the container's --gpus device={metered}",
            ),
        )
    ):
        fine = container_campaign(tmp_path / f"fine{number}", *flags)
        checked = _doctor(fine, env)
        output = " ".join(checked.stdout.split())
        by = by if by.startswith("CUDA") else f"the container's {by}"
        assert f"ok server GPUs: the server is pinned to {metered} ({by})" in output, output


def test_a_variable_set_before_a_container_run_reaches_it_only_where_passed(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`env CUDA_VISIBLE_DEVICES=GPU-<other> docker run --gpus device=GPU-<metered> IMG ...`
    was refused ("sets CUDA_VISIBLE_DEVICES=GPU-<other>, other GPUs than the metered"), though
    docker passes its container none of its own environment but what `-e NAME` names: the
    server sees the metered GPU alone. It is judged by what the container is given: pinned by
    its `--gpus` (the sweep verifies it on the metered GPU), NVIDIA_VISIBLE_DEVICES alike; the
    host's value passed on (`-e CUDA_VISIBLE_DEVICES`) is still refused."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    for number, name in enumerate(("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")):
        path = container_campaign(
            tmp_path / f"c{number}",
            "--gpus",
            f"device={metered}",
            before=("env", f"{name}={other}"),
        )
        checked = _doctor(path, env)
        output = " ".join(checked.stdout.split())
        assert (
            f"ok server GPUs: the server is pinned to {metered} (the container's --gpus "
            f"device={metered})"
        ) in output, output
    server = _swept_server(path, tmp_path / "out", env)
    assert server["gpu_pinning"] == f"verified: GPU 1 ({metered})"
    path = container_campaign(
        tmp_path / "passed",
        "--gpus",
        "all",
        "-e",
        "CUDA_VISIBLE_DEVICES",
        before=("env", f"CUDA_VISIBLE_DEVICES={other}"),
    )
    _refused(
        _doctor(path, env),
        f"FAIL server GPUs: engine.sglang.server_command sets CUDA_VISIBLE_DEVICES={other}, other "
        f"GPUs than the metered {metered}",
    )


def test_gpus_wins_over_nvidia_visible_devices_and_nv_gpu(nv: ModuleType, tmp_path: Path) -> None:
    """`docker run --gpus device=GPU-<metered> -e NVIDIA_VISIBLE_DEVICES=GPU-<other> IMG` (NV_GPU
    for nvidia-docker alike) was refused as giving the container the other GPU. The daemon
    appends NVIDIA_VISIBLE_DEVICES=<--gpus's> to the container's environment after the one `-e`
    gives, and the NVIDIA runtime hook reads the last of a name (or CDI sets it to void): the
    container has the GPUs `--gpus` names. Pinned by it; refused where it names another."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    pinned = (
        f"ok server GPUs: the server is pinned to {metered} (the container's --gpus "
        f"device={metered})"
    )
    for number, (flags, before, engine) in enumerate(
        (
            (
                ("--gpus", f"device={metered}", "-e", f"NVIDIA_VISIBLE_DEVICES={other}"),
                (),
                "docker",
            ),
            ((f"--env=NVIDIA_VISIBLE_DEVICES={other}", f"--gpus=device={metered}"), (), "docker"),
            (("--gpus", f"device={metered}"), ("env", f"NV_GPU={other}"), "nvidia-docker"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", *flags, before=before, engine=engine)
        checked = _doctor(path, env)
        assert checked.returncode == 0, checked.stdout
        assert pinned in " ".join(checked.stdout.split()), checked.stdout
    server = _swept_server(path, tmp_path / "out", env)
    assert server["gpu_pinning"] == f"verified: GPU 1 ({metered})"
    path = container_campaign(
        tmp_path / "other", "--gpus", f"device={other}", "-e", f"NVIDIA_VISIBLE_DEVICES={metered}"
    )
    _refused(
        _doctor(path, env),
        f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
        f"device={other}, other GPUs than the metered {metered}",
    )


def test_podmans_gpus_does_not_win_over_nvidia_visible_devices(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`podman run --gpus device=GPU-<metered> -e NVIDIA_VISIBLE_DEVICES=GPU-<other> IMG` was
    said pinned to the metered GPU, as docker's `--gpus` wins; podman's appends no
    NVIDIA_VISIBLE_DEVICES (podman 4 ignores `--gpus`, podman 5 takes its words as CDI
    names), so the NVIDIA hook reads `-e`'s: the container may run on the other GPU, where
    NVML lists none of its processes. Refused, as without `--gpus`."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    flags = ("--gpus", f"device={metered}", "-e", f"NVIDIA_VISIBLE_DEVICES={other}")
    path = container_campaign(tmp_path / "podman", *flags, engine="podman")
    _refused(
        _doctor(path, env),
        f"FAIL server GPUs: engine.sglang.server_command gives its container "
        f"NVIDIA_VISIBLE_DEVICES={other}, other GPUs than the metered {metered}",
    )


def test_podmans_gpus_is_read_as_podman_reads_it(nv: ModuleType, tmp_path: Path) -> None:
    """podman's `--gpus` was read with docker's syntax: `podman run --gpus device=GPU-<metered>`
    was said pinned, though podman 4 ignores `--gpus` and podman 5 makes each word a CDI name
    (`nvidia.com/gpu=device=GPU-...`, none: the container fails to start); `--gpus
    GPU-<metered>`, the metered GPU to podman 5, was warned of as an index or count, and
    `--gpus device=GPU-<other>` refused with docker's remedy. Which podman runs, dvfs cannot
    tell: each is warned of, naming `--device nvidia.com/gpu=<UUID>` (CDI, read by both)."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    remedy = "give podman --device nvidia.com/gpu=<UUID> of each metered GPU in place of --gpus"
    cases = (
        ((f"--gpus=device={metered}",), f"nvidia.com/gpu=device={metered}, no CDI name"),
        (("--gpus", metered), f"the CDI device(s) nvidia.com/gpu={metered}"),
        (("--gpus", f"device={other}"), f"nvidia.com/gpu=device={other}, no CDI name"),
        (("--gpus", f"{metered},{other}"), f"nvidia.com/gpu={metered} nvidia.com/gpu={other}"),
        (
            ("--gpus", f"device={metered}", "-e", "CUDA_VISIBLE_DEVICES"),
            f"nvidia.com/gpu=device={metered}, no CDI name",
        ),
    )
    for number, (flags, said) in enumerate(cases):
        path = container_campaign(tmp_path / f"c{number}", *flags, engine="podman")
        output = _doctor_warns(path, env)
        assert "podman 4 ignores --gpus" in output, output
        assert said in output and remedy in output, output
    # Given dvfs's CUDA_VISIBLE_DEVICES, a CDI name: podman 5 gives the metered GPU, CUDA picks
    # it (elsewhere the server fails to start); podman 4's runtime gives it, or none.
    path = container_campaign(
        tmp_path / "passed", "--gpus", metered, "-e", "CUDA_VISIBLE_DEVICES", engine="podman"
    )
    checked = _doctor(path, env)
    assert checked.returncode == 0, checked.stdout
    said = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert said in " ".join(checked.stdout.split()), checked.stdout
    # docker's and nerdctl's `--gpus` are docker's syntax: another GPU by UUID is refused
    for engine in ("docker", "nerdctl"):
        path = container_campaign(tmp_path / engine, "--gpus", f"device={other}", engine=engine)
        _refused(
            _doctor(path, env),
            f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
            f"device={other}, other GPUs than the metered {metered}",
        )


def test_an_option_value_naming_an_engine_is_not_whose_gpus_they_are(
    nv: ModuleType, tmp_path: Path
) -> None:
    """Whose `--gpus` it was, docker's or podman's, was read from the nearest word before it
    naming an engine, an option's value too: `docker run --name podman --gpus
    device=GPU-<other> IMG` (`--network podman`, podman's network; `-v
    /usr/bin/podman:/usr/bin/podman`) was warned of as podman's, not refused, and `podman run
    --name docker --gpus device=GPU-<metered> IMG` said pinned, read with docker's syntax,
    though podman 4 ignores it and podman 5 fails to start the container. The engine is the
    program that runs the container."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    for number, value in enumerate(
        (("--name", "podman"), ("--network", "podman"), ("-v", "/usr/bin/podman:/usr/bin/podman"))
    ):
        flags = (*value, "--gpus", f"device={other}")
        path = container_campaign(tmp_path / f"docker{number}", *flags)
        _refused(
            _doctor(path, env),
            f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
            f"device={other}, other GPUs than the metered {metered}",
        )
    flags = ("--name", "docker", "--gpus", f"device={metered}")
    path = container_campaign(tmp_path / "podman", *flags, engine="podman")
    output = _doctor_warns(path, env)
    assert f"podman 5 reads nvidia.com/gpu=device={metered}, no CDI name" in output, output


def test_podman_remote_is_podman(nv: ModuleType, tmp_path: Path) -> None:
    """`podman-remote`, podman's client, was no container engine to dvfs: `podman-remote run
    IMG`, whose container gets none of dvfs's CUDA_VISIBLE_DEVICES, was said pinned by it,
    and `podman-remote run --gpus device=GPU-<metered> IMG` pinned by docker's syntax,
    though podman 4 ignores `--gpus` and podman 5 fails to start the container. Both are
    warned of as podman's are, naming `--device nvidia.com/gpu=...`."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    path = container_campaign(tmp_path / "none", engine="podman-remote")
    output = _doctor_warns(path, env)
    assert "starts a container (podman-remote run) not passed CUDA_VISIBLE_DEVICES" in output
    assert "(-e CUDA_VISIBLE_DEVICES with --device nvidia.com/gpu=all)" in output, output
    flags = ("--gpus", f"device={metered}")
    path = container_campaign(tmp_path / "gpus", *flags, engine="podman-remote")
    output = _doctor_warns(path, env)
    assert f"podman 5 reads nvidia.com/gpu=device={metered}, no CDI name" in output, output
    assert "give podman --device nvidia.com/gpu=<UUID> of each metered GPU" in output, output


def test_podmans_remedy_gives_no_gpus_podman_4_ignores(nv: ModuleType, tmp_path: Path) -> None:
    """A podman container given no GPUs, or another by NVIDIA_VISIBLE_DEVICES, was told to be
    passed `-e CUDA_VISIBLE_DEVICES with --gpus all`: podman 4 ignores `--gpus`, so done so
    the container may have no GPU. The remedy names `--device nvidia.com/gpu=all` (CDI, read
    by podman 4 and 5) for podman; docker's keeps `--gpus all`."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    podman = "(-e CUDA_VISIBLE_DEVICES with --device nvidia.com/gpu=all)"
    docker = "(-e CUDA_VISIBLE_DEVICES with --gpus all)"
    for engine, said in (("podman", podman), ("docker", docker)):
        path = container_campaign(tmp_path / engine, engine=engine)
        output = _doctor_warns(path, env)
        assert f"pass the container dvfs's own CUDA_VISIBLE_DEVICES {said}" in output, output
        flags = ("-e", f"NVIDIA_VISIBLE_DEVICES={other}")
        path = container_campaign(tmp_path / f"{engine}-other", *flags, engine=engine)
        _refused(
            _doctor(path, env),
            f"NVIDIA_VISIBLE_DEVICES={other}, other GPUs than the metered {metered}: the server "
            f"would run where dvfs does not meter; give it the metered GPU(s) by UUID instead "
            f"({metered}), or pass the container dvfs's own CUDA_VISIBLE_DEVICES {said}",
        )


def test_an_execs_nvidia_visible_devices_is_not_its_containers_gpus(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`docker exec -e NVIDIA_VISIBLE_DEVICES=GPU-<metered> CTR python ...` was said pinned to
    the metered GPU "(the container's NVIDIA_VISIBLE_DEVICES=...)", and another GPU's refused
    with the remedy to name the metered one: the NVIDIA runtime reads it only as it makes a
    container, so an exec's gives it no GPUs, and CUDA does not read it. Warned of as any
    exec not passed CUDA_VISIBLE_DEVICES: the server runs on the GPUs the container was made
    with."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    for number, uuid in enumerate((metered, other)):
        flags = ("-e", f"NVIDIA_VISIBLE_DEVICES={uuid}")
        path = container_campaign(tmp_path / f"c{number}", *flags, run=("exec",))
        output = _doctor_warns(path, env)
        assert (
            "engine.sglang.server_command runs the server in a container made before (docker "
            "exec), not passed CUDA_VISIBLE_DEVICES on its command line"
        ) in output, output


def test_nvidia_visible_devices_with_no_container_is_warned_of_not_refused(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`env NVIDIA_VISIBLE_DEVICES=GPU-<other> python -m sglang.launch_server`, no container on
    the command line, was refused as giving "its container" the other GPU, and the sweep
    refused the server: CUDA does not read NVIDIA_VISIBLE_DEVICES, only a container runtime
    does (enroot, apptainer --nv, srun's pyxis), so the server runs on the metered GPU dvfs
    hands it as CUDA_VISIBLE_DEVICES. Doctor warns, saying why, unless it names the metered
    GPU; the sweep starts the server, verified on the metered GPU."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    paths = []
    for number, value in enumerate((other, "0")):
        wrapper = ("env", f"NVIDIA_VISIBLE_DEVICES={value}")
        paths.append(path := observed_campaign(tmp_path / f"c{number}", wrapper))
        output = _doctor_warns(path, env)
        assert (
            f"engine.sglang.server_command sets NVIDIA_VISIBLE_DEVICES={value} with no container "
            "run on its command line, which CUDA does not read: the server runs on the "
            f"CUDA_VISIBLE_DEVICES dvfs hands it (the metered {metered}) unless what it runs "
            "starts a container (enroot, apptainer --nv, srun's pyxis)"
        ) in output, output
        assert (
            "remove NVIDIA_VISIBLE_DEVICES from server_command, or name the metered GPUs there "
            "by UUID: outside a container dvfs pins the server by CUDA_VISIBLE_DEVICES"
        ) in output, output
    server = _swept_server(paths[0], tmp_path / "out", env)
    assert server["gpu_pinning"] == f"verified: GPU 1 ({metered})"
    path = observed_campaign(tmp_path / "metered", ("env", f"NVIDIA_VISIBLE_DEVICES={metered}"))
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_nvidia_visible_devices_set_inside_a_container_is_not_its_gpus(
    nv: ModuleType, tmp_path: Path
) -> None:
    """The NVIDIA runtime reads NVIDIA_VISIBLE_DEVICES from the container's environment as it
    starts it; set by the image's command (`docker run ... IMG env NVIDIA_VISIBLE_DEVICES=...
    python ...`) it gives the container no GPU. Doctor failed `--gpus device=GPU-<metered> IMG
    env NVIDIA_VISIBLE_DEVICES=GPU-<other>` as giving the container the other GPU; the server
    runs on the metered GPU, pinned by `--gpus` (or by the CUDA_VISIBLE_DEVICES it is passed)."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    inside = ("env", f"NVIDIA_VISIBLE_DEVICES={other}")
    for number, (flags, by) in enumerate(
        (
            (("--gpus", f"device={metered}"), f"the container's --gpus device={metered}"),
            (("--gpus", "all", "-e", "CUDA_VISIBLE_DEVICES"), "CUDA_VISIBLE_DEVICES"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", *flags, inside=inside)
        checked = _doctor(path, env)
        output = " ".join(checked.stdout.split())
        assert checked.returncode == 0, output
        assert f"ok server GPUs: the server is pinned to {metered} ({by})" in output, output


def test_a_container_given_gpus_by_index_or_all_is_warned_of_and_recorded(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`docker run --gpus all`, a count, an index (`'"device=0,2"'`, the host's numbering or
    another's), podman's `--device nvidia.com/gpu=all`, `-e NVIDIA_VISIBLE_DEVICES=all`: which
    GPU the server runs on is not known (in a container CUDA's first GPU is not the metered
    one). Doctor said the server was "pinned to" the metered GPU, and the sweep's pinning
    outcome, where NVML could not list processes, said nothing of it. Doctor warns, naming it,
    and the server record (and the cube) says it; not where the container is given dvfs's own
    CUDA_VISIBLE_DEVICES (`-e CUDA_VISIBLE_DEVICES`), whose UUIDs CUDA picks among its GPUs."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    for number, (flags, setting) in enumerate(
        (
            (("--gpus", "all"), "--gpus all"),
            (("--gpus", "2"), "--gpus 2"),
            (("--gpus", '"device=0,2"'), '--gpus "device=0,2"'),
            (("--gpus", "driver=nvidia,count=1"), "--gpus driver=nvidia,count=1"),
            (("--device", "nvidia.com/gpu=all"), "--device nvidia.com/gpu=all"),
            (("-e", "NVIDIA_VISIBLE_DEVICES=all"), "NVIDIA_VISIBLE_DEVICES=all"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", *flags)
        checked = _doctor(path, env)
        line = _server_gpus_line(checked)
        assert line.startswith("warn server GPUs: "), checked.stdout
        said = (
            f"engine.sglang.server_command gives its container {setting} rather than the "
            f"metered {metered}: GPUs by index, count or all, which dvfs cannot check"
        )
        output = " ".join(checked.stdout.split())
        assert said in output and "pinned to" not in output, output
        assert (
            f"{said}: the sweep stops the server only where NVML lists it or its memory "
            "on another GPU; name "
            "the metered GPUs there by UUID, or pass the container dvfs's own "
            "CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES with --gpus all), right for each "
            "fleet worker's GPUs, or outside a container remove it from server_command"
        ) in output
    # Given the CUDA_VISIBLE_DEVICES dvfs hands docker, CUDA in the container picks the metered
    # GPU among all.
    path = container_campaign(tmp_path / "passed", "--gpus", "all", "-e", "CUDA_VISIBLE_DEVICES")
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    _no_process_lists(nv)
    path = container_campaign(tmp_path / "swept", "--gpus", "all")
    server = _swept_server(path, tmp_path / "out", env)
    assert server["gpu_pinning"].startswith("unverified: NVML cannot list")
    assert server["gpu_pinning"].endswith(
        "; engine.sglang.server_command gives its container --gpus all rather than the metered "
        "GPUs' UUIDs: GPUs by index, count or all, which dvfs cannot check"
    )
    assert _pinning(tmp_path) == {"none": server["gpu_pinning"]}


def test_a_container_passed_cuda_visible_devices_needs_only_hold_the_metered_gpus(
    nv: ModuleType, tmp_path: Path
) -> None:
    """A container passed CUDA_VISIBLE_DEVICES by UUID (dvfs's own, `-e CUDA_VISIBLE_DEVICES`,
    or the metered UUIDs written out) runs the server on the metered GPUs among those it is
    given. A fleet's one server_command giving the container the fleet's GPUs (`--gpus
    '"device=GPU-1,GPU-2"' -e CUDA_VISIBLE_DEVICES`, each worker picking its own) was refused
    for every worker ("other GPUs than the metered"), in doctor and at each server start, and
    `--gpus all -e CUDA_VISIBLE_DEVICES=GPU-<metered>` warned that dvfs could not check it.
    Both pass; a container without a metered GPU is still refused, saying to give it that."""
    _no_process_lists(nv)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    uuids = [d["uuid"] for d in nv.fake_state()["devices"]]
    fleet = ("--gpus", f'"device={uuids[1]},{uuids[2]}"', "-e", "CUDA_VISIBLE_DEVICES")
    path = container_campaign(tmp_path / "fleet", *fleet)
    checked = dvfs_in_process(
        "doctor", str(path), "--out", str(tmp_path / "o"), "--gpus", "1,2", env=env
    )
    output = " ".join(checked.stdout.split())
    assert checked.returncode == 0, output
    assert (
        f"ok server GPUs: the servers are pinned to {uuids[1]}; {uuids[2]} (CUDA_VISIBLE_DEVICES; "
        f"the container's --gpus {fleet[1]})"
    ) in output
    out = tmp_path / "out"
    swept = dvfs_in_process(
        "sweep", str(path), "--out", str(out), "--gpus", "1,2", "--no-progress", env=env
    )
    assert swept.returncode == 0, swept.stderr
    records = _journal(out)
    cells = [r for r in records if r["type"] == "cell"]
    assert cells and all(c["status"] == "ok" for c in cells)
    path = container_campaign(
        tmp_path / "written", "--gpus", "all", "-e", f"CUDA_VISIBLE_DEVICES={uuids[1]}"
    )
    checked = dvfs_in_process("doctor", str(path), "--out", str(tmp_path / "o2"), env=env)
    pinned = f"ok server GPUs: the server is pinned to {uuids[1]} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    # Set so inside the container (`IMG env CUDA_VISIBLE_DEVICES=GPU-...`), as `-e` sets it: it
    # was warned of as "--gpus all ..., which dvfs cannot check".
    inside = ("env", f"CUDA_VISIBLE_DEVICES={uuids[1]}")
    path = container_campaign(tmp_path / "inside", "--gpus", "all", inside=inside)
    checked = _doctor(path, env)
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    lacking = ("--gpus", f'"device={uuids[0]},{uuids[2]}"', "-e", "CUDA_VISIBLE_DEVICES")
    path = container_campaign(tmp_path / "lacking", *lacking)
    checked = dvfs_in_process("doctor", str(path), "--out", str(tmp_path / "o3"), env=env)
    assert checked.returncode == 1, checked.stdout
    assert (
        f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
        f"{lacking[1]}, without the metered {uuids[1]} that the CUDA_VISIBLE_DEVICES it is "
        f"passed names: the server cannot start there; give the container the metered GPU(s) "
        f"too ({uuids[1]})"
    ) in " ".join(checked.stdout.split()), checked.stdout


def test_a_container_passed_no_cuda_visible_devices_is_warned_of_and_recorded(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`docker run` passes its container none of the environment dvfs hands it but what `-e
    NAME` names (podman's `--env-host`: all of it): given no GPUs on its command line
    (`--runtime=nvidia`, whose CUDA image sets NVIDIA_VISIBLE_DEVICES=all; `--device
    /dev/nvidia1`; an `--env-file` not setting it), the server runs on the GPUs the
    runtime gives it, CUDA's first. Doctor said it was "pinned to" the metered GPU (by
    CUDA_VISIBLE_DEVICES) and the server record said nothing of it. Doctor warns, naming the
    fix, and the server record says it; `--env-host` passes it on: pinned, and verified."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    env_file = tmp_path / "env.list"
    env_file.write_text("SGLANG_STUB_UNUSED=1\n")
    for number, (engine, flags) in enumerate(
        (
            ("docker", ("--runtime=nvidia",)),
            ("docker", ("--device", "/dev/nvidia1")),
            ("podman", ("--env-file", str(env_file))),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", *flags, engine=engine)
        output = _doctor_warns(path, env)
        gpus = "--device nvidia.com/gpu=all" if engine == "podman" else "--gpus all"
        assert (
            f"engine.sglang.server_command starts a container ({engine} run) not passed "
            "CUDA_VISIBLE_DEVICES on its command line: without it the server runs on the GPUs "
            f"the container runtime gives it (with a CUDA image, all) rather than the metered "
            f"{metered}, which dvfs cannot check: the sweep stops the server only where NVML "
            "lists it or its memory on another GPU; pass the container dvfs's own "
            "CUDA_VISIBLE_DEVICES (-e "
            f"CUDA_VISIBLE_DEVICES with {gpus}), right for each fleet worker's GPUs"
        ) in output, output
    hosted = container_campaign(tmp_path / "hosted", "--env-host", engine="podman")
    checked = dvfs_in_process("doctor", str(hosted), "--out", str(tmp_path / "o"), env=env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    for name, path in (
        ("unpassed", container_campaign(tmp_path / "swept", "--runtime=nvidia")),
        ("hosted", hosted),
    ):
        server = _swept_server(path, tmp_path / f"out-{name}", env)
        if name == "hosted":
            assert server["gpu_pinning"] == f"verified: GPU 1 ({metered})"
            continue
        assert server["gpu_pinning"].startswith("unverified: NVML lists none of the server's")
        assert server["gpu_pinning"].endswith(
            "; engine.sglang.server_command starts a container (docker run) not passed "
            "CUDA_VISIBLE_DEVICES on its command line: without it the server runs on the GPUs "
            "the container runtime gives it (with a CUDA image, all) rather than the metered "
            "GPUs' UUIDs, which dvfs cannot check"
        )


def test_docker_exec_and_nvidia_docker_are_judged_as_containers(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`docker exec CONTAINER ...` runs the server in a container made before, on the GPUs it
    was made with, and `nvidia-docker run` is docker's run: both were read as plain commands,
    "pinned to" the metered GPU by the CUDA_VISIBLE_DEVICES their container never receives
    (`nvidia-docker run --gpus device=GPU-<other>` too). Doctor warns of an exec not passed
    it, naming `-e CUDA_VISIBLE_DEVICES` (passed it, it is pinned), and judges nvidia-docker's
    container as docker's: warned of, or refused where it is given another GPU by UUID."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    path = container_campaign(tmp_path / "exec", run=("exec",))
    output = _doctor_warns(path, env)
    assert (
        "engine.sglang.server_command runs the server in a container made before (docker "
        "exec), not passed CUDA_VISIBLE_DEVICES on its command line: the server runs on the "
        f"GPUs the container was made with rather than the metered {metered}, which dvfs "
        "cannot check: the sweep stops the server only where NVML lists it or its memory "
        "on another GPU; "
        "pass it dvfs's own CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES after exec), the "
        "container made with the metered GPUs (or --gpus all)"
    ) in output, output
    path = container_campaign(tmp_path / "passed", "-e", "CUDA_VISIBLE_DEVICES", run=("exec",))
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    path = container_campaign(tmp_path / "nvidia", engine="nvidia-docker")
    output = _doctor_warns(path, env)
    assert "starts a container (nvidia-docker run) not passed CUDA_VISIBLE_DEVICES" in output
    path = container_campaign(
        tmp_path / "other", "--gpus", f"device={other}", engine="nvidia-docker"
    )
    _refused(
        _doctor(path, env),
        f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
        f"device={other}, other GPUs than the metered {metered}",
    )


def test_nvidia_dockers_nv_gpu_is_read_as_the_containers_gpus(
    nv: ModuleType, tmp_path: Path
) -> None:
    """nvidia-docker's `run` passes docker `-e NVIDIA_VISIBLE_DEVICES=$NV_GPU` (its wrapper
    script) before the options given: `env NV_GPU=GPU-<other> nvidia-docker run IMG ...` runs
    the server on the other GPU, but doctor warned, as of a container given no GPUs, that it
    runs on those the runtime gives it. Another GPU's UUID is refused, the metered one's
    pinned, an index (from dvfs's own environment too) warned of by name; an `-e
    NVIDIA_VISIBLE_DEVICES` given after `run` wins over it."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    path = container_campaign(
        tmp_path / "other", before=("env", f"NV_GPU={other}"), engine="nvidia-docker"
    )
    _refused(
        _doctor(path, env),
        f"FAIL server GPUs: engine.sglang.server_command gives its container NV_GPU={other}, "
        f"other GPUs than the metered {metered}",
    )
    path = container_campaign(
        tmp_path / "metered", before=("env", f"NV_GPU={metered}"), engine="nvidia-docker"
    )
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (the container's NV_GPU={metered})"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    path = container_campaign(tmp_path / "index", engine="nvidia-docker")
    output = _doctor_warns(path, {**env, "NV_GPU": "0"})
    assert (
        f"engine.sglang.server_command gives its container NV_GPU=0 from dvfs's environment "
        f"rather than the metered {metered}: GPUs by index, count or all, which dvfs cannot check"
    ) in output, output
    path = container_campaign(
        tmp_path / "given",
        "-e",
        f"NVIDIA_VISIBLE_DEVICES={metered}",
        before=("env", f"NV_GPU={other}"),
        engine="nvidia-docker",
    )
    checked = _doctor(path, env)
    pinned = (
        f"ok server GPUs: the server is pinned to {metered} (the container's "
        f"NVIDIA_VISIBLE_DEVICES={metered})"
    )
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_nv_gpu_dropped_before_nvidia_docker_gives_its_container_none(
    nv: ModuleType, tmp_path: Path
) -> None:
    """nvidia-docker reads NV_GPU from the environment it is started with: a sudo resetting
    it (`sudo nvidia-docker run`, no -E), an `env -i` or `env -u NV_GPU` before it drops the
    NV_GPU of engine.sglang.env (or dvfs's own), and the container gets the GPUs its runtime
    gives it (with a CUDA image, all). Doctor said the server "pinned to" the metered GPU by
    that NV_GPU, or failed it as giving the container another GPU set before the sudo; it
    warns, as of a container given no GPUs. Kept (`sudo -E`, `--preserve-env=NV_GPU`, or set
    after the drop), NV_GPU is read as before."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    sudo = tmp_path / "sudo"
    sudo.write_text('#!/bin/sh\nexec "$@"\n')  # never run: doctor starts no server
    sudo.chmod(0o755)
    unpassed = (
        "engine.sglang.server_command starts a container (nvidia-docker run) not passed "
        "CUDA_VISIBLE_DEVICES on its command line"
    )
    for number, before in enumerate(
        (
            (str(sudo),),
            (str(sudo), "-i", "-u", "svc"),
            ("env", "-i", "PATH=/usr/bin"),
            ("env", "-u", "NV_GPU"),
            ("env", f"NV_GPU={other}", str(sudo), "-u", "svc"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", before=before, engine="nvidia-docker")
        output = _doctor_warns(path, {**env, "NV_GPU": metered})
        assert unpassed in output, output
    pinned = f"ok server GPUs: the server is pinned to {metered} (the container's NV_GPU={metered}"
    for number, before in enumerate(
        (
            (str(sudo), "-E"),
            (str(sudo), "--preserve-env=NV_GPU", "-u", "svc"),
            ("env", "-i", f"NV_GPU={metered}"),
            (str(sudo), f"NV_GPU={metered}"),
        )
    ):
        path = container_campaign(tmp_path / f"k{number}", before=before, engine="nvidia-docker")
        checked = _doctor(path, {**env, "NV_GPU": other if "=" in before[-1] else metered})
        assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_an_nv_gpu_refused_says_where_it_is_set_and_to_unset_it(
    nv: ModuleType, tmp_path: Path
) -> None:
    """An NV_GPU naming another GPU in engine.sglang.env or dvfs's own environment was refused
    as "server_command gives its container NV_GPU=...", which server_command does not say, and
    told to pass the container dvfs's CUDA_VISIBLE_DEVICES (`--gpus all -e
    CUDA_VISIBLE_DEVICES`), refused again while NV_GPU stayed. The refusal names where it is
    set and says to unset it for that."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    path = container_campaign(tmp_path / "campaign", engine="nvidia-docker")
    text = path.read_text()
    path.write_text(text.replace("env = { ", f'env = {{ NV_GPU = "{other}", ', 1))
    said = (
        f"FAIL server GPUs: engine.sglang.server_command gives its container NV_GPU={other} "
        f"{{}}, other GPUs than the metered {metered}: the server would run where dvfs does not "
        f"meter; give it the metered GPU(s) by UUID instead ({metered}), or unset NV_GPU and "
        "pass the container dvfs's own CUDA_VISIBLE_DEVICES"
    )
    _refused(_doctor(path, env), said.format("from engine.sglang.env"))
    path = container_campaign(tmp_path / "own", engine="nvidia-docker")
    _refused(_doctor(path, {**env, "NV_GPU": other}), said.format("from dvfs's environment"))


def test_a_bare_e_nvidia_visible_devices_passes_the_environments(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`docker run -e NVIDIA_VISIBLE_DEVICES IMG` passes the container the value of the
    environment docker is started with: engine.sglang.env's, or dvfs's own. dvfs read it only
    from the command line (`env NVIDIA_VISIBLE_DEVICES=... docker run`): another GPU's UUID
    in dvfs's environment was warned of as a container "not passed CUDA_VISIBLE_DEVICES",
    though the server runs on that GPU. Refused, naming where it is set; the metered UUID
    pinned; dropped before docker (`env -i`), warned of as before."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    said = (
        f"FAIL server GPUs: engine.sglang.server_command gives its container "
        f"NVIDIA_VISIBLE_DEVICES={other} {{}}, other GPUs than the metered {metered}: the "
        "server would run where dvfs does not meter; give it the metered GPU(s) by UUID instead "
        f"({metered}), or pass it no NVIDIA_VISIBLE_DEVICES and pass the container dvfs's own "
        "CUDA_VISIBLE_DEVICES"
    )
    path = container_campaign(tmp_path / "own", "-e", "NVIDIA_VISIBLE_DEVICES")
    own = {**env, "NVIDIA_VISIBLE_DEVICES": other}
    _refused(_doctor(path, own), said.format("from dvfs's environment"))
    path = container_campaign(tmp_path / "campaign", "-e", "NVIDIA_VISIBLE_DEVICES")
    text = path.read_text()
    path.write_text(text.replace("env = { ", f'env = {{ NVIDIA_VISIBLE_DEVICES = "{other}", ', 1))
    _refused(
        _doctor(path, {**env, "NVIDIA_VISIBLE_DEVICES": metered}),
        said.format("from engine.sglang.env"),
    )
    path = container_campaign(tmp_path / "metered", "-e", "NVIDIA_VISIBLE_DEVICES")
    checked = _doctor(path, {**env, "NVIDIA_VISIBLE_DEVICES": metered})
    pinned = (
        f"ok server GPUs: the server is pinned to {metered} (the container's "
        f"NVIDIA_VISIBLE_DEVICES={metered} from dvfs's environment)"
    )
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    path = container_campaign(
        tmp_path / "dropped", "-e", "NVIDIA_VISIBLE_DEVICES", before=("env", "-i", "PATH=/usr/bin")
    )
    output = _doctor_warns(path, own)
    assert "starts a container (docker run) not passed CUDA_VISIBLE_DEVICES" in output, output


def test_an_env_file_setting_the_gpus_is_read_as_e_is(nv: ModuleType, tmp_path: Path) -> None:
    """`docker run --env-file FILE` passes the container FILE's variables as `-e` does, but
    dvfs did not read it: a file passing CUDA_VISIBLE_DEVICES (dvfs's own, or the metered UUID)
    was warned of ("not passed CUDA_VISIBLE_DEVICES", "--gpus all ... cannot check"), and one
    giving the container another GPU's NVIDIA_VISIBLE_DEVICES was warned of, not refused. A
    readable file is read: pinned, or refused as `-e` is; an unreadable one is warned of."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    for number, (line, flags) in enumerate(
        (
            ("CUDA_VISIBLE_DEVICES", ()),
            (f"CUDA_VISIBLE_DEVICES={metered}", ("--gpus", "all")),
            (f"NVIDIA_VISIBLE_DEVICES={other}", ()),
        )
    ):
        env_file = tmp_path / f"env{number}.list"
        env_file.write_text(f"# the server's\nHF_HOME=/cache\n{line}\n")
        path = container_campaign(tmp_path / f"c{number}", *flags, "--env-file", str(env_file))
        checked = _doctor(path, env)
        output = " ".join(checked.stdout.split())
        if line.startswith("NVIDIA"):
            assert checked.returncode == 1, output
            # doctor wraps to the console's width, the file's long path mid-word too
            assert _unwrapped(
                f"FAIL server GPUs: engine.sglang.server_command gives its container "
                f"NVIDIA_VISIBLE_DEVICES={other} in --env-file {env_file}, other GPUs than the "
                f"metered {metered}"
            ) in _unwrapped(output), output
        else:
            assert pinned in output, output
    path = container_campaign(tmp_path / "unread", "--env-file", str(tmp_path / "missing"))
    assert "starts a container (docker run) not passed" in _doctor_warns(path, env)


def test_an_env_file_beyond_the_settings_bound_is_not_read(tmp_path: Path) -> None:
    """An `--env-file` was read whole, unbounded: /dev/zero-like (a disk image, a huge log
    given by mistake) until memory ran out. One beyond the settings files' bound is not read
    (as an unreadable one, warned of by doctor); bytes not UTF-8 in one read are replaced."""
    from dvfs.engines.server_gpus import _env_files
    from dvfs.inputs import MAX_SETTINGS_BYTES

    huge = tmp_path / "huge.env"
    with huge.open("wb") as f:
        f.write(b"CUDA_VISIBLE_DEVICES=GPU-1\n")
        f.truncate(MAX_SETTINGS_BYTES + 1)  # sparse: no disk used
    small = tmp_path / "small.env"
    small.write_bytes(b"HF_HOME=/c\xff\n")
    command = ["docker", "run", "--env-file", str(huge), f"--env-file={small}", "IMG"]
    assert _env_files(command) == ["HF_HOME=/c\ufffd"]


def test_an_env_file_that_is_a_fifo_is_not_read(tmp_path: Path) -> None:
    """An `--env-file` that is a FIFO (`<(...)` written down, a named pipe) was opened and
    read blocking: doctor and the sweep waited on it for ever, and what they read of it the
    container would not get. It is not read, as an unreadable file is not."""
    from dvfs.engines.server_gpus import _env_files

    fifo = tmp_path / "env.fifo"
    os.mkfifo(fifo)
    assert _env_files(["docker", "run", "--env-file", str(fifo), "IMG"]) == []


def test_e_name_wins_over_an_env_files_value(nv: ModuleType, tmp_path: Path) -> None:
    """docker passes a container an `--env-file`'s variables, then `-e`'s over them: with
    `-e CUDA_VISIBLE_DEVICES` (dvfs's own) beside a shared env file setting
    CUDA_VISIBLE_DEVICES=GPU-<other>, the server sees the metered GPU. Doctor failed it,
    "sets CUDA_VISIBLE_DEVICES=GPU-<other>, other GPUs than the metered" (the sweep refused
    it); `-e` after or before the file, it is pinned by dvfs's CUDA_VISIBLE_DEVICES."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    env_file = tmp_path / "server.env"
    env_file.write_text(f"HF_HOME=/cache\nCUDA_VISIBLE_DEVICES={other}\n")
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    for number, flags in enumerate(
        (
            ("--env-file", str(env_file), "-e", "CUDA_VISIBLE_DEVICES"),
            ("-e", "CUDA_VISIBLE_DEVICES", f"--env-file={env_file}"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", "--gpus", "all", *flags)
        checked = _doctor(path, env)
        assert checked.returncode == 0, checked.stdout
        assert pinned in " ".join(checked.stdout.split()), checked.stdout
    path = container_campaign(tmp_path / "file", "--gpus", "all", "--env-file", str(env_file))
    checked = _doctor(path, env)
    assert checked.returncode == 1, checked.stdout
    # the file named, and the remedy said there, not in server_command (doctor wraps to the
    # console's width, the file's long path mid-word too)
    assert _unwrapped(
        f"FAIL server GPUs: engine.sglang.server_command sets CUDA_VISIBLE_DEVICES={other} in "
        f"--env-file {env_file}, other GPUs than the metered {metered}: the server would run "
        "where dvfs does not meter; remove it from that --env-file (dvfs pins the server to "
        "the metered GPUs by UUID)"
    ) in _unwrapped(checked.stdout), checked.stdout


def test_the_last_e_of_a_name_is_what_the_container_sees(nv: ModuleType, tmp_path: Path) -> None:
    """docker passes a container the last `-e` of a name: `-e CUDA_VISIBLE_DEVICES=GPU-<other>
    -e CUDA_VISIBLE_DEVICES` gives it dvfs's own (the metered GPU), yet doctor failed it as
    setting the other GPU; and `-eCUDA_VISIBLE_DEVICES=GPU-<other>` (the value attached) was
    not read at all, "pinned to" the metered GPU while the server ran on the other. The last
    `-e` is judged, attached or not."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    given = ("-e", f"CUDA_VISIBLE_DEVICES={other}", "-e", "CUDA_VISIBLE_DEVICES")
    checked = _doctor(container_campaign(tmp_path / "last", "--gpus", "all", *given), env)
    assert checked.returncode == 0, checked.stdout
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    refused = f"sets CUDA_VISIBLE_DEVICES={other}, other GPUs than the metered {metered}"
    for number, flags in enumerate((given[2:] + given[:2], (f"-eCUDA_VISIBLE_DEVICES={other}",))):
        path = container_campaign(tmp_path / f"c{number}", "--gpus", "all", *flags)
        checked = _doctor(path, env)
        assert checked.returncode == 1, checked.stdout
        assert refused in " ".join(checked.stdout.split()), checked.stdout


def test_a_container_run_in_a_shell_line_is_judged_as_one(nv: ModuleType, tmp_path: Path) -> None:
    """`sh -c 'docker run --gpus ... IMG "$@"' sh` (`bash -lc`) was read as one word: said
    "pinned to" the metered GPU by the CUDA_VISIBLE_DEVICES its container never receives,
    given another GPU by UUID or not. The line's words are judged as written outside a shell:
    refused, warned of, or pinned by what the container is given."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    folder = tmp_path / "other"
    folder.mkdir()
    line = f'exec docker run --rm --gpus device={other} IMG "$@"'
    path = observed_campaign(folder, ("sh", "-c", line, "sh"))
    _refused(
        _doctor(path, env),
        f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
        f"device={other}, other GPUs than the metered {metered}",
    )
    folder = tmp_path / "unpassed"
    folder.mkdir()
    path = observed_campaign(folder, ("bash", "-lc", 'docker run --gpus all IMG "$@"', "bash"))
    output = _doctor_warns(path, env)
    assert "gives its container --gpus all rather than the metered" in output, output
    folder = tmp_path / "passed"
    folder.mkdir()
    line = 'docker run --gpus all -e "CUDA_VISIBLE_DEVICES" IMG "$@"'
    path = observed_campaign(folder, ("sh", "-c", line, "sh"))
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_a_shell_line_after_options_taking_a_word_is_judged(nv: ModuleType, tmp_path: Path) -> None:
    """`bash -o pipefail -c 'docker run --gpus device=GPU-<other> IMG "$@"'` (`-eo pipefail`,
    `-O extglob`, `-c` before them) was read as one word, `pipefail` taken for the end of the
    shell's options: said "pinned to" the metered GPU by a CUDA_VISIBLE_DEVICES its container
    never receives, the server to run on the other GPU. The line after the options' words is
    judged: refused, or warned of."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    line = f'exec docker run --rm --gpus device={other} IMG "$@"'
    for number, options in enumerate(
        (("-o", "pipefail", "-c"), ("-eo", "pipefail", "-c"), ("-O", "extglob", "-lc"))
    ):
        folder = tmp_path / f"c{number}"
        folder.mkdir()
        _refused(
            _doctor(observed_campaign(folder, ("bash", *options, line, "bash")), env),
            f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
            f"device={other}, other GPUs than the metered {metered}",
        )
    folder = tmp_path / "all"
    folder.mkdir()
    line = 'exec docker run --rm --gpus all IMG "$@"'
    path = observed_campaign(folder, ("bash", "-c", "-o", "pipefail", line, "bash"))
    assert "gives its container --gpus all rather than the metered" in _doctor_warns(path, env)


def test_a_shell_lines_own_cuda_visible_devices_is_dvfss(nv: ModuleType, tmp_path: Path) -> None:
    """A shell line's `$CUDA_VISIBLE_DEVICES` is the metered GPUs' UUIDs dvfs hands the shell:
    `sh -c 'docker run --gpus all -e CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES" IMG "$@"'`
    was warned of as "sets CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES ..., an index dvfs cannot
    check", `--gpus "device=$CUDA_VISIBLE_DEVICES"` (`-e NVIDIA_VISIBLE_DEVICES=...`) as GPUs
    "by index, count or all". Each is pinned, as `-e CUDA_VISIBLE_DEVICES`; set before the
    shell to another GPU, the line is refused as naming it."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    other, metered = (d["uuid"] for d in nv.fake_state()["devices"][:2])
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    for number, flags in enumerate(
        (
            '--gpus all -e CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"',
            '--gpus "device=$CUDA_VISIBLE_DEVICES"',
            "--gpus=device=${CUDA_VISIBLE_DEVICES}",
            "--runtime=nvidia -e NVIDIA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES",
        )
    ):
        folder = tmp_path / f"c{number}"
        folder.mkdir()
        line = f'exec docker run --rm {flags} IMG "$@"'
        checked = _doctor(observed_campaign(folder, ("sh", "-c", line, "sh")), env)
        output = " ".join(checked.stdout.split())
        assert checked.returncode == 0 and pinned in output, output
    folder = tmp_path / "before"
    folder.mkdir()
    line = 'exec docker run --rm --gpus "device=$CUDA_VISIBLE_DEVICES" IMG "$@"'
    wrapper = ("env", f"CUDA_VISIBLE_DEVICES={other}", "sh", "-c", line, "sh")
    _refused(
        _doctor(observed_campaign(folder, wrapper), env),
        f"FAIL server GPUs: engine.sglang.server_command gives its container --gpus "
        f"device={other}, other GPUs than the metered {metered}",
    )


def test_a_compose_run_container_passed_no_cuda_visible_devices_is_warned_of(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`docker compose run SERVICE ...` (`docker-compose run`) starts the service's container
    with the environment its compose file names, which dvfs does not read, not the
    CUDA_VISIBLE_DEVICES dvfs hands it. Doctor said "pinned to" the metered GPU (by
    CUDA_VISIBLE_DEVICES). It warns as for `docker run`, naming compose's fix (compose's run
    takes `-e` but no `--gpus`); passed `-e CUDA_VISIBLE_DEVICES`, it is pinned."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    for number, (engine, run, words) in enumerate(
        (
            ("docker", ("compose", "run"), "docker compose run"),
            ("docker", ("compose", "-f", "compose.yaml", "run", "--rm"), "docker compose run"),
            ("docker-compose", ("run",), "docker-compose run"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", engine=engine, run=run)
        output = _doctor_warns(path, env)
        assert (
            f"engine.sglang.server_command starts a container ({words}) not passed "
            "CUDA_VISIBLE_DEVICES on its command line: without it the server runs on the GPUs "
            f"the container runtime gives it (with a CUDA image, all) rather than the metered "
            f"{metered}, which dvfs cannot check: the sweep stops the server only where NVML "
            "lists it or its memory on another GPU; pass the container dvfs's own "
            "CUDA_VISIBLE_DEVICES (-e "
            "CUDA_VISIBLE_DEVICES after run, the compose file reserving it every GPU), right "
            "for each fleet worker's GPUs"
        ) in output, output
    path = container_campaign(
        tmp_path / "passed", "-e", "CUDA_VISIBLE_DEVICES", run=("compose", "run")
    )
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_srun_gpus_is_warned_of_as_slurms_not_a_containers(nv: ModuleType, tmp_path: Path) -> None:
    """`srun --gpus=1` (Slurm) was warned of as "gives its container --gpus 1", with a remedy
    for containers: srun is no container; its `--gpus` is a count of GPUs Slurm picks and names
    in its own CUDA_VISIBLE_DEVICES, in place of dvfs's, as it does for a container srun starts
    (whose `-e CUDA_VISIBLE_DEVICES` then passes on Slurm's). Doctor says so, with srun's fix."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nshift\nexec "$@"\n')  # drops its one option
    srun.chmod(0o755)
    slurms = (
        f"engine.sglang.server_command gives srun --gpus 1 in place of the metered {metered}: "
        "GPUs Slurm picks by count and names in its own CUDA_VISIBLE_DEVICES, which dvfs cannot "
        "check"
    )
    for number, (before, said) in enumerate(
        (
            (
                (),
                f"{slurms}: the sweep stops the server only where NVML lists it or its memory "
                "on another GPU; "
                "drop srun from server_command and run dvfs itself in the Slurm job, which "
                "starts the server on the metered GPUs",
            ),
            (("--gpus", "all", "-e", "CUDA_VISIBLE_DEVICES"), slurms),
        )
    ):
        folder = tmp_path / f"c{number}"
        if before:
            path = container_campaign(folder, *before, before=(str(srun), "--gpus=1"))
        else:
            path = observed_campaign(folder, (str(srun), "--gpus=1"))
        checked = dvfs_in_process("doctor", str(path), "--out", str(folder / "o"), env=env)
        output = " ".join(checked.stdout.split())
        line = _server_gpus_line(checked)
        assert line.startswith("warn server GPUs: "), output
        assert said in output and "its container --gpus 1" not in output, output


def test_srun_gres_and_g_are_warned_of_as_srun_gpus_is(nv: ModuleType, tmp_path: Path) -> None:
    """Slurm gives a job step GPUs by `--gres=gpu:N`, `-G N` (`-GN`) or `--gpus-per-task` as
    by `--gpus`, naming them in its own CUDA_VISIBLE_DEVICES in place of dvfs's: doctor said
    the server was "pinned to" the metered GPU (by CUDA_VISIBLE_DEVICES). It warns as for
    `--gpus`, with srun's fix; a gres that is no GPU (`--gres=craynetwork:1`) is left alone."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nexec "$@"\n')  # never run: doctor starts no server
    srun.chmod(0o755)
    for number, (options, setting) in enumerate(
        (
            (("--gres=gpu:1",), "--gres gpu:1"),
            (("--gres", "gpu:h100:1"), "--gres gpu:h100:1"),
            (("-G", "1"), "-G 1"),
            (("-G1",), "-G 1"),
            (("--gpus-per-task=1",), "--gpus-per-task 1"),
        )
    ):
        path = observed_campaign(tmp_path / f"c{number}", (str(srun), *options))
        output = _doctor_warns(path, env)
        assert (
            f"engine.sglang.server_command gives srun {setting} in place of the metered "
            f"{metered}: GPUs Slurm picks by count and names in its own CUDA_VISIBLE_DEVICES, "
            "which dvfs cannot check: the sweep stops the server only where NVML lists it or "
            "its memory on another GPU; drop srun from server_command and run dvfs itself in the "
            "Slurm job"
        ) in output, output
    path = observed_campaign(tmp_path / "network", (str(srun), "--gres=craynetwork:1"))
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_an_env_dropping_cuda_visible_devices_is_warned_of_and_recorded(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`env -i` or `env -u CUDA_VISIBLE_DEVICES` in server_command drops the UUIDs dvfs hands
    the wrapper: the server runs on CUDA's first GPU(s). Doctor said it was "pinned to" the
    metered GPU (by CUDA_VISIBLE_DEVICES), and where NVML could not list processes the server
    record said nothing of it. Doctor warns, naming it and the fix, and the server record says
    it; `env -i CUDA_VISIBLE_DEVICES=<the metered UUID>` sets it again: pinned."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]

    for number, (wrapper, setting) in enumerate(
        (
            (("env", "-i"), "env -i"),
            (("env", "-u", "CUDA_VISIBLE_DEVICES"), "env -u CUDA_VISIBLE_DEVICES"),
            (("env", "--unset=CUDA_VISIBLE_DEVICES"), "env --unset=CUDA_VISIBLE_DEVICES"),
        )
    ):
        path = observed_campaign(tmp_path / f"c{number}", wrapper)
        output = _doctor_warns(path, env)
        assert (
            f"engine.sglang.server_command drops CUDA_VISIBLE_DEVICES ({setting}) in place of "
            f"the metered {metered}: the server then runs on CUDA's first GPU(s), which dvfs "
            "cannot check: the sweep stops the server only where NVML lists it or its memory "
            "on another GPU; "
            "remove it from server_command: dvfs hands the server CUDA_VISIBLE_DEVICES = the "
            "metered GPUs' UUIDs"
        ) in output, output
    path = observed_campaign(tmp_path / "set", ("env", "-i", f"CUDA_VISIBLE_DEVICES={metered}"))
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout
    # A container not passed CUDA_VISIBLE_DEVICES runs on the GPUs it is given whatever drops
    # it, before the container or inside it.
    for number, (before, inside) in enumerate(
        ((("env", "-i"), ()), ((), ("env", "-u", "CUDA_VISIBLE_DEVICES")))
    ):
        path = container_campaign(
            tmp_path / f"given{number}", "--gpus", f"device={metered}", before=before, inside=inside
        )
        checked = _doctor(path, env)
        pinned = (
            f"ok server GPUs: the server is pinned to {metered} (the container's --gpus "
            f"device={metered})"
        )
        assert pinned in " ".join(checked.stdout.split()), checked.stdout
    _no_process_lists(nv)
    path = observed_campaign(tmp_path / "swept", ("env", "-u", "CUDA_VISIBLE_DEVICES"))
    server = _swept_server(path, tmp_path / "out", env)
    assert server["gpu_pinning"].startswith("unverified: NVML cannot list")
    assert server["gpu_pinning"].endswith(
        "; engine.sglang.server_command drops CUDA_VISIBLE_DEVICES (env -u "
        "CUDA_VISIBLE_DEVICES) in place of the metered GPUs' UUIDs: the server then runs on "
        "CUDA's first GPU(s), which dvfs cannot check"
    )


def test_sudo_without_e_is_warned_of_as_dropping_cuda_visible_devices(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`sudo -u USER python -m sglang.launch_server` (dvfs as root, the server as a user) resets
    the environment, CUDA_VISIBLE_DEVICES with it, unless sudoers keeps it: doctor said the
    server was "pinned to" the metered GPU (by CUDA_VISIBLE_DEVICES). It warns, saying to give
    sudo -E; `sudo -E` and `--preserve-env=...,CUDA_VISIBLE_DEVICES` keep it: pinned."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    sudo = tmp_path / "sudo"
    sudo.write_text('#!/bin/sh\nexec "$@"\n')  # never run: doctor starts no server
    sudo.chmod(0o755)
    for number, options in enumerate((("-u", "svc"), ("--user=svc", "--preserve-env=PATH"))):
        path = observed_campaign(tmp_path / f"c{number}", (str(sudo), *options))
        output = _doctor_warns(path, env)
        assert (
            "engine.sglang.server_command drops CUDA_VISIBLE_DEVICES (sudo without -E, unless "
            f"its sudoers keeps it) in place of the metered {metered}: the server then runs on "
            "CUDA's first GPU(s), which dvfs cannot check: the sweep stops the server only where "
            "NVML lists it or its memory on another GPU; give sudo -E (or "
            "--preserve-env=CUDA_VISIBLE_DEVICES), which keeps the CUDA_VISIBLE_DEVICES dvfs "
            "hands the server"
        ) in output, output
    for number, options in enumerate(
        (("-Eu", "svc"), ("-u", "svc", "--preserve-env=PATH,CUDA_VISIBLE_DEVICES"))
    ):
        path = observed_campaign(tmp_path / f"kept{number}", (str(sudo), *options))
        checked = _doctor(path, env)
        pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
        assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_sudos_chroot_and_auth_type_take_a_word(nv: ModuleType, tmp_path: Path) -> None:
    """sudo's `-R DIR` (`--chroot DIR`) and `-a TYPE` (`--auth-type TYPE`) take the next word
    (sudo's parse_args.c), but dvfs read that word as sudo's command, the options after it
    unread: `sudo -R /srv/jail -E python ...` was warned of as "sudo without -E" dropping
    CUDA_VISIBLE_DEVICES. Their values are skipped: -E keeps it, pinned."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    sudo = tmp_path / "sudo"
    sudo.write_text('#!/bin/sh\nexec "$@"\n')  # never run: doctor starts no server
    sudo.chmod(0o755)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    for number, options in enumerate(
        (("-R", "/srv/jail", "-E"), ("--chroot", "/srv/ssh", "-E"), ("-a", "pam", "-E"))
    ):
        checked = _doctor(observed_campaign(tmp_path / f"c{number}", (str(sudo), *options)), env)
        assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_sudo_i_is_warned_of_as_dropping_cuda_visible_devices(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`sudo -i` runs the server in the target user's login shell, whose environment sudo
    initialises (sudoers(5): "regardless of the value of env_reset"), keeping only its
    sudoers' env_keep: doctor warns, saying to give --preserve-env=CUDA_VISIBLE_DEVICES (or -E
    in place of -i). That list sudo passes on as variables set on its command line, after -i
    resets the environment (sudo's parse_args.c; fixed for -i in sudo 1.8.24): `sudo -i
    --preserve-env=CUDA_VISIBLE_DEVICES` was warned of, told to give what it gave; it is
    pinned. With -E, `sudo -iE` runs nothing ("you may not specify both the -i and -E
    options"): doctor warned that the server would run on CUDA's first GPU ("resetting the
    environment even with -E"); it fails it, as the sweep refuses the server."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    sudo = tmp_path / "sudo"
    sudo.write_text('#!/bin/sh\nexec "$@"\n')  # never run: doctor starts no server
    sudo.chmod(0o755)
    path = observed_campaign(tmp_path / "login", (str(sudo), "-i", "-u", "svc"))
    output = _doctor_warns(path, env)
    assert (
        "engine.sglang.server_command drops CUDA_VISIBLE_DEVICES (sudo -i, a login shell "
        "resetting the environment, unless its sudoers keeps it) in place of the metered "
        f"{metered}: the server then runs on CUDA's first GPU(s), which dvfs cannot check: the "
        "sweep stops the server only where NVML lists it or its memory on another GPU; give sudo "
        "--preserve-env=CUDA_VISIBLE_DEVICES, which keeps the CUDA_VISIBLE_DEVICES dvfs hands "
        "the server with -i too (or -E in place of -i)"
    ) in output, output
    said = (
        "engine.sglang.server_command gives sudo -i and -E together, with which sudo runs "
        'nothing ("you may not specify both the -i and -E options"): the server would not '
        "start; give sudo --preserve-env=CUDA_VISIBLE_DEVICES in place of -E, which keeps the "
        "CUDA_VISIBLE_DEVICES dvfs hands the server with -i too"
    )
    for number, options in enumerate((("-iE", "-u", "svc"), ("-E", "--login", "--user=svc"))):
        path = observed_campaign(tmp_path / f"c{number}", (str(sudo), *options))
        _refused(_doctor(path, env), f"FAIL server GPUs: {said}")
    out = tmp_path / "out"
    swept = _sweep_into(path, out, env)
    assert swept.returncode == 5, swept.stderr
    records = _journal(out)
    assert not [r for r in records if r["type"] == "server"]
    [cell] = [r for r in records if r["type"] == "cell"]
    assert cell["status"] == "failed" and said in cell["error"]
    for number, options in enumerate(
        (
            ("-i", "--preserve-env=CUDA_VISIBLE_DEVICES"),
            ("--login", "--preserve-env=PATH,CUDA_VISIBLE_DEVICES", "-u", "svc"),
        )
    ):
        path = observed_campaign(tmp_path / f"kept{number}", (str(sudo), *options))
        checked = _doctor(path, env)
        pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
        assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_ssh_and_kubectl_are_warned_of_as_running_the_server_elsewhere(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`ssh HOST ...` runs the server on HOST with none of dvfs's environment (ssh passes on
    none), `kubectl run`/`exec` in a pod on the node and GPUs Kubernetes picks: both were
    said "pinned to" the metered GPU by CUDA_VISIBLE_DEVICES. Doctor warns, with the fix (run
    dvfs where the server runs); not refused, as HOST may be this one. Setting the metered
    UUID after the host (`ssh HOST env CUDA_VISIBLE_DEVICES=GPU-...`) pins it there."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    for number, (wrapper, said) in enumerate(
        (
            (
                ("ssh", "-p", "2222", "-o", "BatchMode=yes", "gpu-host"),
                "runs the server through ssh gpu-host, which passes it none of dvfs's "
                "CUDA_VISIBLE_DEVICES: on that host, on CUDA's first GPU(s) rather than the "
                f"metered {metered}, which dvfs cannot check: the sweep stops the server only "
                "where NVML lists it or its memory on another GPU; run dvfs itself on the host "
                "that serves, "
                "whose GPUs it then meters and pins the server to, and drop ssh from "
                "server_command",
            ),
            (
                ("kubectl", "run", "sglang", "--image=IMG", "--restart=Never", "--"),
                "runs the server in a Kubernetes pod (kubectl run), on a node and GPUs "
                f"Kubernetes picks rather than the metered {metered}, which dvfs cannot check: "
                "the sweep stops the server only where NVML lists it or its memory "
                "on another GPU; run dvfs "
                "itself in the pod, which starts the server on the metered GPUs",
            ),
            (
                ("kubectl", "-n", "ml", "exec", "sglang-0", "--"),
                "in a Kubernetes pod (kubectl exec)",
            ),
        )
    ):
        path = observed_campaign(tmp_path / f"c{number}", wrapper)
        output = _doctor_warns(path, env)
        assert said in output, output
    wrapper = ("ssh", "-tt", "localhost", "env", f"CUDA_VISIBLE_DEVICES={metered}")
    path = observed_campaign(tmp_path / "set", wrapper)
    checked = _doctor(path, env)
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_a_mount_ending_in_a_launchers_name_is_no_launcher(nv: ModuleType, tmp_path: Path) -> None:
    """A container's mount whose target is `/ssh`, `/sudo` or `/env` (`-v /srv/keys:/ssh`) was
    read as that program: "runs the server through ssh IMG", "drops CUDA_VISIBLE_DEVICES (sudo
    without -E ...)", "(env -i)" before docker's own `-i`. A word holding `:` or `=` is an
    option's value, no program: the container passed dvfs's CUDA_VISIBLE_DEVICES is pinned."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    passed = ("--gpus", "all", "-e", "CUDA_VISIBLE_DEVICES")
    for number, mount in enumerate(
        (
            ("-v", "/srv/keys:/ssh"),
            ("--volume=/srv/tools:/sudo",),
            ("-v", "/srv/tools:/env", "-i"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", *passed, *mount)
        checked = _doctor(path, env)
        output = " ".join(checked.stdout.split())
        pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
        assert pinned in output, output


def test_a_container_options_path_ending_in_a_launchers_name_is_no_launcher(
    nv: ModuleType, tmp_path: Path
) -> None:
    """A mount with no `:` (an anonymous volume `-v /ssh`, `--tmpfs /run/sudo`) or a workdir
    (`-w /srv/env`) ending in `/ssh`, `/sudo` or `/env` was read as that program, as a
    `SRC:DST` mount was: "runs the server through ssh IMG", "drops CUDA_VISIBLE_DEVICES (sudo
    without -E ...)", "(env -i)" before docker's own `-i`. The value of a container run's
    option, before its image, is no program: the container passed dvfs's
    CUDA_VISIBLE_DEVICES is pinned; a sudo in the command the image runs is still read."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    passed = ("--gpus", "all", "-e", "CUDA_VISIBLE_DEVICES")
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    for number, option in enumerate(
        (
            ("-v", "/ssh"),
            ("--tmpfs", "/run/sudo"),
            ("-w", "/srv/env", "-i"),
            ("-it", "--workdir", "/ssh"),
        )
    ):
        path = container_campaign(tmp_path / f"c{number}", *passed, *option)
        checked = _doctor(path, env)
        assert pinned in " ".join(checked.stdout.split()), checked.stdout
    path = container_campaign(tmp_path / "sudo", "-i", *passed, inside=("sudo", "-u", "svc"))
    output = _doctor_warns(path, env)
    assert "drops CUDA_VISIBLE_DEVICES (sudo without -E, unless its sudoers keeps it)" in output


def test_a_directory_ending_in_a_launchers_name_is_no_launcher(
    nv: ModuleType, tmp_path: Path
) -> None:
    """A directory ending in `/ssh` or `/sudo` outside a container's options was read as that
    program: `bash -lc 'cd /srv/ssh && exec "$@"'`, `srun -D /srv/ssh`, `env --chdir
    /srv/sudo` said the server runs "through ssh ..." or that sudo drops CUDA_VISIBLE_DEVICES,
    beside srun's own `--gpus` warning too. `cd`'s argument, the value of an option of srun,
    env or sudo, and an option word are no program: pinned; an ssh the line runs is still
    read."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    metered = nv.fake_state()["devices"][1]["uuid"]
    launchers = {}
    for name in ("srun", "sudo"):
        launchers[name] = tmp_path / name
        launchers[name].write_text('#!/bin/sh\nexec "$@"\n')  # never run: doctor starts none
        launchers[name].chmod(0o755)
    srun, sudo = str(launchers["srun"]), str(launchers["sudo"])
    pinned = f"ok server GPUs: the server is pinned to {metered} (CUDA_VISIBLE_DEVICES)"
    for number, wrapper in enumerate(
        (
            ("bash", "-lc", 'cd /srv/ssh && exec "$@"', "bash"),
            (srun, "-D", "/srv/ssh"),
            (srun, "-D/srv/ssh"),
            (srun, "-lF", "/srv/ssh"),
            (srun, "--chdir", "/srv/sudo"),
            ("env", "--chdir", "/srv/sudo"),
            ("env", "-C", "/srv/ssh"),
            (sudo, "-E", "--chdir", "/srv/ssh"),
        )
    ):
        checked = _doctor(observed_campaign(tmp_path / f"c{number}", wrapper), env)
        assert pinned in " ".join(checked.stdout.split()), checked.stdout
    path = observed_campaign(tmp_path / "gpus", (srun, "--gpus=1", "-D", "/srv/ssh"))
    output = _doctor_warns(path, env)
    assert f"gives srun --gpus 1 in place of the metered {metered}" in output, output
    assert "through ssh" not in output, output
    path = observed_campaign(
        tmp_path / "ssh", ("bash", "-lc", 'cd /srv/ssh && exec ssh gpu-host "$@"', "bash")
    )
    assert "runs the server through ssh gpu-host" in _doctor_warns(path, env)


def test_a_fleet_container_refused_or_warned_of_is_told_what_serves_every_worker(
    nv: ModuleType, tmp_path: Path
) -> None:
    """A fleet's workers share one server_command. Its container given one worker's GPU by
    UUID was refused for the other, told to give it that worker's UUID instead (which the
    first worker's check then refuses), and `--gpus all` was warned of with "name the metered
    GPUs there by UUID", which no one command can for two workers. Both now also say what
    serves every worker, dvfs's own CUDA_VISIBLE_DEVICES passed on, and doing so passes."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    uuids = [d["uuid"] for d in nv.fake_state()["devices"]]
    advice = (
        "pass the container dvfs's own CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES with "
        "--gpus all), right for each fleet worker's GPUs"
    )
    for number, (flags, status) in enumerate(
        ((("--gpus", f"device={uuids[1]}"), "FAIL"), (("--gpus", "all"), "warn"))
    ):
        path = container_campaign(tmp_path / f"c{number}", *flags)
        checked = dvfs_in_process(
            "doctor", str(path), "--out", str(tmp_path / f"o{number}"), "--gpus", "1,2", env=env
        )
        output = " ".join(checked.stdout.split())
        line = _server_gpus_line(checked)
        assert line.startswith(f"{status} server GPUs: "), output
        assert advice in output, output
    path = container_campaign(tmp_path / "advised", "--gpus", "all", "-e", "CUDA_VISIBLE_DEVICES")
    checked = dvfs_in_process(
        "doctor", str(path), "--out", str(tmp_path / "o"), "--gpus", "1,2", env=env
    )
    pinned = (
        f"ok server GPUs: the servers are pinned to {uuids[1]}; {uuids[2]} (CUDA_VISIBLE_DEVICES)"
    )
    assert pinned in " ".join(checked.stdout.split()), checked.stdout


def test_doctor_gpus_checks_the_gpus_servers_and_ports_of_the_sweep_on_those_gpus(
    nv: ModuleType, tmp_path: Path
) -> None:
    """`dvfs doctor --gpus LIST` preflights `dvfs sweep --gpus LIST` (doctor had no --gpus and
    checked only gpu.devices): on three fake GPUs, a GPU the machine lacks fails it as the
    sweep refuses it; each group's server is checked against the campaign env's
    CUDA_VISIBLE_DEVICES (pinned to gpu.devices' GPU 1: the fleet's worker on GPU 0 would fail
    every cell); a fleet's servers each need a block of ports, one server a free port."""
    import fcntl

    from dvfs.engines.sglang_args import PORT_SLOTS, ServerPorts

    path, marker = on_gpu_1(tmp_path)
    ports = tmp_path / "ports"
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES, DVFS_PORT_LOCK_DIR=str(ports))

    def doctor(*args: str) -> tuple[int, dict[str, dict]]:
        done = dvfs_in_process(
            "doctor", str(path), "--out", str(tmp_path / "c"), *args, "--json", env=env
        )
        return done.returncode, {c["name"]: c for c in json.loads(done.stdout)}

    code, checks = doctor("--gpus", "0-3")
    assert code == 2 and checks["driver"]["status"] == "fail", checks
    swept = dvfs_in_process(
        "sweep", str(path), "--gpus", "0-3", "--out", str(tmp_path / "o"), "--no-progress", env=env
    )
    assert swept.returncode == 2 and checks["driver"]["detail"] in swept.stderr, swept.stderr
    assert "GPU 3" in checks["driver"]["detail"]
    swept_locks = set(ports.iterdir()) if ports.exists() else set()

    code, checks = doctor("--gpus", "0-2")
    assert code == 0, checks
    assert [f"lock GPU {i}" in checks for i in range(3)] == [True] * 3
    assert "3 workers: gpu0 (" in checks["workers"]["detail"] and checks["ports"]["status"] == "ok"

    uuids = [d["uuid"] for d in nv.fake_state()["devices"]]
    path.write_text(
        path.read_text().replace("env = { ", f'env = {{ CUDA_VISIBLE_DEVICES = "{uuids[1]}", ')
    )
    code, checks = doctor()
    assert code == 0 and checks["server GPUs"]["status"] == "ok", checks
    code, checks = doctor("--gpus", "0-1")
    assert code == 1 and checks["server GPUs"]["status"] == "fail", checks
    assert (
        f"contradicts gpu.devices: dvfs pins the server to the metered GPU(s) {uuids[0]}"
        in (checks["server GPUs"]["detail"])
    )
    assert doctor("--gpus", "1")[0] == 0  # the sweep's one server on GPU 1: as pinned

    # Every block of ports but one held by other dvfs workers: two servers cannot both start.
    ports.mkdir(exist_ok=True)  # the refused sweep's workers claimed blocks there
    held = []
    for slot in range(1, PORT_SLOTS):
        fd = os.open(ports / f"{ServerPorts.for_slot(slot).http}.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    try:
        path.write_text(path.read_text().replace(f'CUDA_VISIBLE_DEVICES = "{uuids[1]}", ', ""))
        code, checks = doctor("--gpus", "1-2")
        assert code == 1 and checks["ports"]["status"] == "fail", checks
        assert f"{PORT_SLOTS - 1} held by other dvfs workers" in checks["ports"]["detail"]
        code, checks = doctor("--gpus", "2")  # one server: no block claimed, a free port
        assert code == 0 and checks["ports"]["status"] == "ok", checks
        assert "block" not in checks["ports"]["detail"], checks
    finally:
        for fd in held:
            os.close(fd)
    mine = {ports / f"{ServerPorts.for_slot(slot).http}.lock" for slot in range(1, PORT_SLOTS)}
    assert set(ports.iterdir()) == swept_locks | mine  # doctor created no lock file
    assert running(marker) == []


def test_doctor_fails_a_tensor_parallel_group_spanning_two_gpu_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`engine.tp_size = 2` on an H100 and an H200: the sweep refuses that one server and a
    fleet of such groups (`--gpus 0-3`), exit 2; doctor passed both. It fails them now (exit
    2, as the sweep), and passes `--gpus 0,2`, one model."""
    fresh_fake(tmp_path, monkeypatch, "h100-sxm,h200-sxm,h100-sxm,h200-sxm")
    path = _tp2_campaign(tmp_path)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES="h100-sxm,h200-sxm,h100-sxm,h200-sxm")
    env["DVFS_FAKE_NVML_ROOT"] = "1"

    def doctor(*args: str) -> tuple[int, dict]:
        done = dvfs_in_process(
            "doctor", str(path), "--out", str(tmp_path / "c"), *args, "--json", env=env
        )
        return done.returncode, {c["name"]: c for c in json.loads(done.stdout)}["workers"]

    for args in ((), ("--gpus", "0-3")):
        got, workers = doctor(*args)
        assert (got, workers["status"]) == (2, "fail"), (args, workers)
        assert "worker gpu0+1 spans GPUs of different models" in workers["detail"]
    fleet = dvfs_in_process(
        "sweep", str(path), "--gpus", "0-3", "--out", str(tmp_path / "o"), "--no-progress", env=env
    )
    assert fleet.returncode == 2 and "spans GPUs of different models" in fleet.stderr
    got, workers = doctor("--gpus", "0,2")
    assert got == 0 and workers["detail"] == "1 worker: gpu0+2 (NVIDIA H100 80GB HBM3)", workers


def test_a_sweep_whose_server_spans_two_gpu_models_is_refused_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One SGLang server (`engine.tp_size = 2`, no fleet) on an H100 and an H200: the sweep
    started it, measured every cell, then refused the cube (its GPUs do not compare). It is
    refused now before the journal is made or the server started, exit 2, in doctor's line
    naming each GPU's model (`--gpus 0-1` too, the same server); GPUs of one model sweep.
    Its dry run planned it and exited 0: it reads the GPUs' models too (changing nothing) and
    refuses it in the sweep's line, exit 2; one model plans."""
    devices = "h100-sxm,h200-sxm,h100-sxm"
    nv = fresh_fake(tmp_path, monkeypatch, devices)
    path, marker = stub_campaign(
        tmp_path,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        gpu='backend = "nvml"\ndevices = [0, 1]',
    )
    path.write_text(path.read_text().replace("[engine.sglang]", "tp_size = 2\n\n[engine.sglang]"))
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=devices, DVFS_FAKE_NVML_ROOT="1")
    checked = dvfs_in_process("doctor", str(path), "--out", str(tmp_path / "c"), "--json", env=env)
    said = {c["name"]: c for c in json.loads(checked.stdout)}["workers"]["detail"]
    names = [nv.FAKE_PROFILES[d["profile"]]["name"] for d in nv.fake_state()["devices"]]
    assert f"(GPU 0: {names[0]}, GPU 1: {names[1]})" in said and names[0] != names[1]

    knobs = ("locked_clocks", "power_limit_mw", "persistence_mode")

    def settings() -> list[tuple]:
        return [tuple(d[k] for k in knobs) for d in nv.fake_state()["devices"]]

    before = settings()
    for args in ((), ("--gpus", "0-1")):
        out = tmp_path / "out"
        planned = dvfs_in_process(
            "sweep", str(path), "--out", str(out), *args, "--dry-run", "--no-estimate", env=env
        )
        assert planned.returncode == 2, (args, planned.stdout + planned.stderr)
        assert planned.stderr.strip() == f"Error: {said}", args
        assert nv.fake_calls() == [] and settings() == before  # read only
        swept = dvfs_in_process(
            "sweep", str(path), "--out", str(out), *args, "--no-progress", env=env
        )
        assert swept.returncode == 2, (args, swept.stdout + swept.stderr)
        assert swept.stderr.strip() == f"Error: {said}", args
        assert not out.exists()  # no journal, no server log: nothing began
        assert running(marker) == []
    assert checked.returncode == 2  # as the sweep refuses it

    out = tmp_path / "one-model"
    plan = ("--gpus", "0,2", "--out", str(out), "--dry-run", "--no-estimate")
    planned = dvfs_in_process("sweep", str(path), *plan, env=env)
    assert planned.returncode == 0 and not planned.stderr, planned.stdout + planned.stderr
    swept = dvfs_in_process("sweep", str(path), "--gpus", "0,2", "--out", str(out), env=env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert (out / "cube.nc").is_file() and running(marker) == []


def test_run_sweep_with_a_callers_backends_refuses_two_gpu_models_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_sweep` from Python with backends of its caller's (an H100 and an H200 behind one
    server) skipped the check the CLI's path makes: it measured every cell, then refused the
    cube. It refuses them now in the same line, before the journal is made."""
    from dvfs.backends import Backends
    from dvfs.campaign import load_campaign
    from dvfs.clock import MonotonicClock
    from dvfs.engines.twin import TwinEngine
    from dvfs.errors import CampaignError
    from dvfs.sweep import run_sweep
    from dvfs.twin.device import FreeRunningNode
    from dvfs.twin.profiles import gpu_profile, model_profile

    nv = fresh_fake(tmp_path, monkeypatch, "h100-sxm,h200-sxm")
    path = _tp2_campaign(tmp_path)
    clock = MonotonicClock()
    engine = TwinEngine(
        FreeRunningNode(gpu_profile("h100-sxm"), clock), model_profile("llama-3.1-8b")
    )
    out = tmp_path / "out"
    with open_nvml_gpus([0, 1], nvml=nv) as gpus:
        names = [g.identity.name for g in gpus]
        with pytest.raises(CampaignError) as refused:
            run_sweep(
                load_campaign(path),
                out,
                backends=Backends(clock, list(gpus), engine),
                state_dir=tmp_path / "dvfs-state",
            )
    assert str(refused.value).startswith("worker gpu0+1 spans GPUs of different models")
    assert f"(GPU 0: {names[0]}, GPU 1: {names[1]})" in str(refused.value)
    assert not out.exists() and nv.fake_calls() == []


def test_a_dry_run_that_cannot_read_the_gpu_models_says_so(tmp_path: Path) -> None:
    """Planned where NVML cannot open the GPUs (a laptop planning for a GPU node), the dry
    run of a server on two GPUs plans, exit 0, and says in one line that their models went
    unchecked (the sweep there would refuse two models)."""
    path = _tp2_campaign(tmp_path)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_MISSING="1")
    planned = dvfs_in_process(
        "sweep", str(path), "--out", str(tmp_path / "o"), "--dry-run", "--no-estimate", env=env
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    note = planned.stderr.strip()
    assert note.startswith("note: the GPUs' models were not read (") and "\n" not in note, note
    assert "NVML" in note and "not checked here" in note


@pytest.mark.parametrize("profile", [None, "h100-sxm"])
@pytest.mark.parametrize("fault", ["no such GPU", "lost", "clock", "power limit"])
def test_the_dry_run_on_one_real_gpu_says_what_would_stop_the_sweep_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, profile: str | None
) -> None:
    """A campaign on one real GPU: `dvfs sweep --dry-run --no-estimate` did not open it (with
    a `gpu.profile`; without one it read its model only, a failure being a note), so a GPU
    index not here, a GPU fallen off the bus, or a clock or power limit it does not take
    planned silently, where the sweep (and `dvfs doctor`) refuse. The dry run opens it
    read-only as the sweep does and says, in one note in the sweep's words, that the sweep
    would stop on this machine; it still plans (exit 0, the plan as without the fault): a
    workstation with a GPU of its own may be planning for another machine. Where NVML does not
    answer at all it plans with no note."""
    from nvml_support import NVML_CAMPAIGN

    nv = fresh_fake(tmp_path, monkeypatch, "h100-sxm,h100-sxm")
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    if profile is not None:  # the twin's load named: nothing else made the dry run open it
        text = text.replace('backend = "nvml"', f'backend = "nvml"\nprofile = "{profile}"', 1)
    path = tmp_path / "one.toml"
    path.write_text(text)
    plan = ("sweep", str(path), "--dry-run", "--no-estimate", "--out", str(tmp_path / "plan"))
    good = dvfs_in_process(*plan, env=env)
    assert good.returncode == 0 and good.stderr == "", good.stdout + good.stderr
    if fault == "lost":
        nv.fake_update_device(0, lost=True)
    else:
        old, new = {
            "no such GPU": ("devices = [0]", "devices = [7]"),
            "clock": ("sm_clock = [1980, 1500]", "sm_clock = [1980, 1507]"),
            "power limit": ("power_limit = [700, 400]", "power_limit = [750, 400]"),
        }[fault]
        assert old in text
        path.write_text(text.replace(old, new))
    dry = dvfs_in_process(*plan, env=env)
    assert nv.fake_calls() == []  # read only
    out = str(tmp_path / "o")
    swept = dvfs_in_process("sweep", str(path), "--out", out, "--no-progress", env=env)
    assert swept.returncode != 0 and len(swept.stderr.splitlines()) == 1, swept.stderr
    stopped = swept.stderr.strip().removeprefix("Error: ")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    note = dry.stderr.strip()
    said = f"note: on this machine the sweep would stop: {stopped}"
    # one line; a GPU not opened leaves its model unread too, which the note then adds
    assert "\n" not in note and note.startswith(said), note
    assert note == said or (profile is None and fault in ("no such GPU", "lost")), note
    assert "cells" in dry.stdout and dry.stdout.count("\n") == good.stdout.count("\n")
    blind = dvfs_in_process(*plan, env={**env, "DVFS_FAKE_NVML_MISSING": "1"})
    assert blind.returncode == 0 and "Error" not in blind.stderr, blind.stdout + blind.stderr


@pytest.mark.parametrize("profile", [None, "h100-sxm"])
def test_the_dry_run_of_a_real_fleet_mixing_gpu_models_counts_each_models_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: str | None
) -> None:
    """A fleet of real GPUs of two models (`--gpus 0-2`: H100, H200, H100) runs the whole
    campaign once per model, as on the twin; its dry run counted one model, and so half the
    cells and hours, until a journal per model existed. It reads the GPUs' models (changing
    nothing) and counts each model's cells; the fleet then measures that many, and a dry run
    of the finished folder finds them all done, of one with a cell left that cell; an H100
    alone (`--gpus 0`, a fleet of one resuming its model's journal only) counted the H200's
    cell too, and finds nothing left now. Where NVML cannot be read, it counts one model (or
    every model's journal) and says so. A `gpu.profile` (the twin that estimates the
    campaign's GPU time) is no real GPU's model: with it, the dry run counted one model and,
    resuming, looked for that profile's journal (none: nothing done)."""
    from nvml_support import NVML_CAMPAIGN

    devices = "h100-sxm,h200-sxm,h100-sxm"
    nv = fresh_fake(tmp_path, monkeypatch, devices)
    path = tmp_path / "fleet.toml"
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    if profile is not None:
        text = text.replace('backend = "nvml"', f'backend = "nvml"\nprofile = "{profile}"', 1)
    path.write_text(text)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=devices, DVFS_FAKE_NVML_ROOT="1")
    out = tmp_path / "out"
    plan = ("sweep", str(path), "--gpus", "0-2", "--out", str(out), "--no-estimate")
    knobs = ("locked_clocks", "power_limit_mw", "persistence_mode")

    def settings() -> list[tuple]:
        return [tuple(d[k] for k in knobs) for d in nv.fake_state()["devices"]]

    before = settings()

    def dry(environment: dict[str, str]) -> tuple[dict, str]:
        done = dvfs_in_process(*plan, "--dry-run", "--json", env=environment)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout), done.stderr

    doc, note = dry(env)
    assert (doc["gpu_models"], doc["workers"], note) == (2, 3, "")
    assert doc["cells_all_models"] == 2 * doc["cells"] == doc["remaining"]
    assert nv.fake_calls() == [] and settings() == before  # read only
    swept = dvfs_in_process(*plan[:-1], "--no-progress", env=env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    journals = sorted(out.glob("gpu-*/journal.jsonl"))
    measured = [
        sum(1 for line in j.read_text().splitlines() if '"type":"cell"' in line) for j in journals
    ]
    assert measured == [doc["cells"], doc["cells"]]
    doc, _ = dry(env)
    assert (doc["already_done"], doc["remaining"]) == (2 * doc["cells"], 0)
    lines = journals[-1].read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if '"type":"cell"' in line)
    journals[-1].write_text("".join(lines[:last] + lines[last + 1 :]))  # its last cell left
    doc, _ = dry(env)
    assert (doc["already_done"], doc["remaining"]) == (2 * doc["cells"] - 1, 1)
    # The H100 alone (`--gpus 0`, the GPUs left after a node loss) goes on as a fleet of one,
    # resuming its model's journal only, which holds every cell: it counted the H200's too.
    alone = dvfs_in_process(*plan[:3], "0", *plan[4:], "--dry-run", "--json", env=env)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    left = json.loads(alone.stdout)
    assert (left["already_done"], left["remaining"]) == (doc["cells"], 0), left

    blind = fake_env(tmp_path, DVFS_FAKE_NVML_MISSING="1")
    doc, note = dry({**blind, "DVFS_FAKE_NVML_DEVICES": devices})
    assert note.startswith("note: the GPUs' models were not read (") and "\n" not in note.strip()
    assert "a fleet mixing GPU models is counted as one model" in note
    unread = {**blind, "DVFS_FAKE_NVML_DEVICES": devices}
    alone = dvfs_in_process(*plan[:3], "0", *plan[4:], "--dry-run", "--json", env=unread)
    assert alone.returncode == 0 and json.loads(alone.stdout)["remaining"] == 1
    assert "every GPU model's journal in the folder is counted here" in alone.stderr

    # A GPU NVML answers for but cannot open (the H200 fallen off the bus) is no refusal of
    # the dry run, as the README once said: it plans (exit 0) and says in the sweep's words,
    # in one note, that the sweep would stop on this machine. (The sweep's other workers say
    # what they began meanwhile, before its one error line.)
    nv.fake_update_device(1, lost=True)
    swept = dvfs_in_process(*plan[:-1], "--no-progress", env=env)
    [error] = [line for line in swept.stderr.splitlines() if line.startswith("Error: ")]
    assert swept.returncode != 0 and error == swept.stderr.splitlines()[-1], swept.stderr
    stopped = error.removeprefix("Error: ")
    doc, note = dry(env)
    assert "\n" not in note.strip(), note
    assert note.startswith(f"note: on this machine the sweep would stop: {stopped}"), note
    assert "fallen off the bus" in note and doc["remaining"] == 1, doc


def test_nvml_without_process_lists_leaves_the_server_unverified(
    nv: ModuleType, tmp_path: Path
) -> None:
    """Nor memory: where the server took it cannot tell either (`_no_process_lists`)."""
    _no_process_lists(nv)
    code, cells, servers, output = _sweep(tmp_path)
    assert code == 0, output
    assert cells and all(c["status"] == "ok" for c in cells)
    pinning = _pinning(tmp_path)["none"]
    assert pinning.startswith("unverified: NVML cannot list the compute processes of GPU 0")
    assert "Not Supported" in pinning and "lists none" not in pinning
    assert "; memory cannot tell: NVML cannot read the memory of GPU 0 (" in pinning, pinning
    assert servers[0]["gpu_pinning"] == pinning


def test_a_resume_keeps_the_pinning_of_the_server_that_measured_the_earlier_cells(
    nv: ModuleType, tmp_path: Path
) -> None:
    """The first run's server unverified (NVML lists no processes), the run cut before its last
    cell, the resume's server verified: the cube says both, as its cells were measured under
    both, not the resume's alone."""
    path, marker = stub_campaign(
        tmp_path,
        drafters=ONE_DRAFTER,
        batch="[1, 2]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        gpu='backend = "nvml"\ndevices = [1]',
    )
    out = tmp_path / "out"
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    _no_process_lists(nv)
    first = _sweep_into(path, out, env)
    assert first.returncode == 0, first.stderr
    journal = out / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "cell"
    journal.write_text("".join(lines[:-1]))  # the run cut before its last cell
    for index in range(3):
        nv.fake_update_device(index, errors={})
    again = _sweep_into(path, out, env)
    assert again.returncode == 0, again.stderr
    assert running(marker) == []
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len([r for r in records if r["type"] == "cell"]) == 2
    uuid = nv.fake_state()["devices"][1]["uuid"]
    unverified, verified = (r["gpu_pinning"] for r in records if r["type"] == "server")
    assert unverified.startswith("unverified: ") and verified == f"verified: GPU 1 ({uuid})"
    assert _pinning(tmp_path) == {"none": f"{unverified}; {verified}"}


# -- the parts -----------------------------------------------------------------------------------


def test_the_process_tree_holds_the_group_and_its_descendants() -> None:
    # A group leader whose child is in its group, and a grandchild that left it (setsid).
    script = "sleep 30 & echo $!; setsid sleep 30 & echo $!; wait"
    leader = subprocess.Popen(
        ["sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    escaped = 0
    try:
        assert leader.stdout is not None
        child, escaped = int(leader.stdout.readline()), int(leader.stdout.readline())
        tree = server_pids(leader.pid)
        assert {leader.pid, child, escaped} <= tree
        assert os.getpid() not in tree
        mine = server_pids(os.getpid())
        assert {os.getpid(), leader.pid, child, escaped} <= mine
    finally:
        if escaped:  # in a session of its own: the group's kill does not reach it
            os.kill(escaped, signal.SIGKILL)
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_the_process_tree_of_a_missing_proc_is_the_root(tmp_path: Path) -> None:
    assert server_pids(42, tmp_path / "no-proc") == frozenset({42})


def test_pinning_outcomes() -> None:
    a, b, c = (GpuProcesses(i, f"GPU-{x}", frozenset()) for i, x in enumerate("abc"))
    on = GpuProcesses(1, "GPU-b", frozenset({7, 99}))
    ours = frozenset({7, 8})
    assert pinning_outcome("d", ours, [a, on, c], ["GPU-b"]) == "verified: GPU 1 (GPU-b)"
    none_seen = pinning_outcome("d", ours, [a, b, c], ["GPU-b"])
    assert none_seen.startswith("unverified: NVML lists none of the server's 2 process(es)")
    blind = GpuProcesses(2, "GPU-c", None, "not supported")
    assert pinning_outcome("d", ours, [a, on, blind], ["GPU-b"]) == (
        "unverified: NVML cannot list the compute processes of GPU 2 (not supported)"
    )
    every_blind = [GpuProcesses(i, f"GPU-{x}", None, "not supported") for i, x in enumerate("ab")]
    assert pinning_outcome("d", ours, every_blind, ["GPU-b"]) == (
        "unverified: NVML cannot list the compute processes of GPU 0, GPU 1 (not supported)"
    )
    half = pinning_outcome("d", ours, [a, on, c], ["GPU-b", "GPU-c"])
    assert half == "unverified: NVML lists the server on GPU 1 but not on the metered GPU-c"
    stray = GpuProcesses(0, "GPU-a", frozenset({8}))
    with pytest.raises(EngineError, match=r"'d' server runs on GPU 0 \(GPU-a\), which dvfs"):
        pinning_outcome("d", ours, [stray, on, blind], ["GPU-b"])


def test_compute_pids_through_nvml(nv: ModuleType) -> None:
    nv.fake_add_process(1, os.getpid())
    nv.fake_add_process(nv.fake_state()["devices"][2]["uuid"], os.getpid())
    with open_nvml_gpus([0, 1], nvml=nv) as (gpu0, gpu1):
        assert gpu0.compute_pids() == frozenset()
        assert gpu1.compute_pids() == frozenset({os.getpid()})
        nv.fake_update_device(1, errors={LIST_FN: nv.NVML_ERROR_NO_PERMISSION})
        assert gpu1.compute_pids() is None
        nv.fake_update_device(1, errors={LIST_FN: nv.NVML_ERROR_NOT_SUPPORTED})
        assert gpu1.compute_pids() is None
        every = gpu_processes(nv)
    assert [(g.index, g.pids) for g in every] == [
        (0, frozenset()),
        (1, None),
        (2, frozenset({os.getpid()})),
    ]
    assert "Not Supported" in every[1].why
    nv.fake_remove_process(os.getpid())
    assert all(not d["processes"] for d in nv.fake_state()["devices"])


def test_the_fake_lists_live_processes_only(nv: ModuleType) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    nv.fake_add_process(0, gone.pid)
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        assert nv.nvmlDeviceGetComputeRunningProcesses(handle) == []
        nv.fake_add_process(0, os.getpid(), used_bytes=123)
        [proc] = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        assert (proc.pid, proc.usedGpuMemory) == (os.getpid(), 123)
    finally:
        nv.nvmlShutdown()


def test_old_server_records_read_without_pinning() -> None:
    old = {"drafter": "none", "engine": "sglang", "version": "0.5.23", "args": {}}
    assert Server.from_json(old).gpu_pinning is None
    new = Server("none", "sglang", "0.5.23", {}, gpu_pinning="verified: GPU 0 (GPU-a)")
    assert Server.from_json(new.to_json()) == new


def test_merged_shards_keep_every_shards_pinning_outcome() -> None:
    """Shards of one run may have started their servers on different hosts: the merged cube
    keeps each drafter's distinct outcomes, not the first shard's alone."""
    import json

    import xarray as xr

    from dvfs.cube.merge import _combined_attrs

    def shard(pinning: dict[str, str]) -> xr.Dataset:
        attrs = {"gpu_pinning": json.dumps(pinning), "gpu_uuids": "GPU-a", "idle_power_w": 70.0}
        return xr.Dataset(attrs=attrs)

    merged = _combined_attrs(
        [
            shard({"none": "verified: GPU 0", "eagle3": "verified: GPU 0"}),
            shard({"none": "unverified: no PIDs listed", "eagle3": "verified: GPU 0"}),
        ],
        ["0", "1"],
    )
    assert json.loads(merged["gpu_pinning"]) == {
        "eagle3": "verified: GPU 0",
        "none": "verified: GPU 0; unverified: no PIDs listed",
    }


def test_the_twin_engine_on_a_gpu_the_twin_has_no_profile_of_is_refused_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The twin engine on real GPUs (`engine.backend = "twin"`, `gpu.backend = "nvml"`) put the
    H100 SXM's load and times on an H20, a GPU the twin has no profile of, and said nothing:
    the cube recorded no profile. The sweep (a fleet's too, and their dry runs) refuses it now
    in one line before anything begins, naming the GPU and `gpu.profile`; doctor fails it as
    the sweep does; with
    `gpu.profile` set it sweeps, and the cube records that profile."""
    from nvml_support import NVML_CAMPAIGN

    devices = "h20,h20"
    fresh_fake(tmp_path, monkeypatch, devices)
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    text = text.replace("power_limit = [700, 400]", "power_limit = [400]")  # an H20's
    path = tmp_path / "c.toml"
    path.write_text(text)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=devices, DVFS_FAKE_NVML_ROOT="1")
    for args in ((), ("--gpus", "0,1")):
        out = tmp_path / "out"
        swept = dvfs_in_process("sweep", str(path), "--out", str(out), *args, env=env)
        said = swept.stderr.strip()
        assert swept.returncode == 2, (args, swept.stdout + said)
        assert said.startswith("Error: ") and len(said.splitlines()) == 1, said
        assert "no profile of NVIDIA H20" in said and "set gpu.profile" in said, said
        assert not out.exists()  # no journal: the campaign, changed, sweeps into this folder
        # its dry run reads the GPUs' model too (changing nothing) and refuses it alike
        plan = ("--out", str(out), *args, "--dry-run", "--no-estimate")
        planned = dvfs_in_process("sweep", str(path), *plan, env=env)
        assert planned.returncode == 2 and planned.stderr.strip() == said, planned.stderr
    checked = dvfs_in_process("doctor", str(path), "--out", str(tmp_path / "c"), "--json", env=env)
    assert checked.returncode == 2
    [load] = [c for c in json.loads(checked.stdout) if c["name"] == "twin load"]
    assert load["status"] == "fail" and "no profile of NVIDIA H20" in load["detail"], load
    path.write_text(text.replace("devices = [0]", 'devices = [0]\nprofile = "h100-sxm"'))
    out = tmp_path / "out"
    swept = _sweep_into(path, out, env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert dvfs.open_cube(str(out / "cube.nc")).attrs["twin_profile"] == "h100-sxm"


def test_doctor_checks_the_twin_load_of_every_gpu_model_of_a_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models under the twin engine (`--gpus 0,1` on an H100 and an H20):
    the sweep refuses the H20, which the twin has no profile of (its worker's load), but
    doctor checked the first GPU's model only and said the H100's load went on every GPU,
    exit 0. It checks each model now, fails as the sweep refuses (exit 2), and names each
    model's load where the twin has a profile of each."""
    from nvml_support import NVML_CAMPAIGN

    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    text = text.replace("power_limit = [700, 400]", "power_limit = [400]")  # an H20's
    path = tmp_path / "c.toml"
    path.write_text(text)
    for devices, code in (("h100-sxm,h20", 2), ("h100-sxm,h200-sxm", 0)):
        fresh_fake(tmp_path, monkeypatch, devices)
        env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=devices, DVFS_FAKE_NVML_ROOT="1")
        out = tmp_path / "out"
        args = ("--out", str(out), "--gpus", "0,1")
        checked = dvfs_in_process("doctor", str(path), *args, "--json", env=env)
        [load] = [c for c in json.loads(checked.stdout) if c["name"] == "twin load"]
        assert checked.returncode == code, (devices, load)
        if code:
            assert load["status"] == "fail" and "no profile of NVIDIA H20" in load["detail"]
            swept = dvfs_in_process("sweep", str(path), *args, "--no-progress", env=env)
            assert swept.returncode == 2 and "no profile of NVIDIA H20" in swept.stderr
        else:
            assert load["status"] == "ok", load
            for key, name in (("h100-sxm", "NVIDIA H100 80GB HBM3"), ("h200-sxm", "NVIDIA H200")):
                assert f"{key}'s on the {name}" in load["detail"], load
            # The driver line names every model of the fleet, not the first GPU's as all's.
            [driver] = [c for c in json.loads(checked.stdout) if c["name"] == "driver"]
            assert driver["detail"].endswith(
                "2 GPU(s): NVIDIA H100 80GB HBM3 x1, NVIDIA H200 x1"
            ), driver
