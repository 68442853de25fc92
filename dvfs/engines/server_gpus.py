"""Which GPUs the SGLang server will see, judged against the metered ones before it starts.

dvfs pins the server by handing it CUDA_VISIBLE_DEVICES = the metered GPUs' UUIDs (CUDA and
NVML may number GPUs differently; a UUID means the same GPU to both). A campaign's own env, or a
`server_command` wrapper (`env CUDA_VISIBLE_DEVICES=...`, a container's `--gpus` /
`--device nvidia.com/gpu=` / NVIDIA_VISIBLE_DEVICES / nvidia-docker's NV_GPU, Slurm's `srun
--gpus`), can move it: what surely names other GPUs is refused here, what cannot be judged (an
index, a count, `all`, a container not passed the variable, a `docker exec`, an `env -i` or a
`sudo` dropping it, `ssh` or `kubectl` running it elsewhere) is said by `dvfs doctor` and in
the server record. What the server sees is judged: a container only what it is passed, a
shell's `-c` line by its words.
The sweep and doctor share these rules; NVML's process check at start (`dvfs.engines.sglang`)
is the second line.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dvfs.campaign.model import Campaign
from dvfs.campaign.serving import server_command
from dvfs.errors import EngineError
from dvfs.gpu.base import names_gpu


def check_visible_devices(env: Mapping[str, str], gpu_uuids: Sequence[str]) -> None:
    """Refuse a campaign env whose CUDA_VISIBLE_DEVICES names other GPUs than the metered ones."""
    value = dict(env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return
    given = [v.strip() for v in value.split(",") if v.strip()]
    # NVML's, lower-case; pasted upper-cased, or a UUID's start (as CUDA reads it), the same GPUs
    if len(given) != len(gpu_uuids) or not all(
        names_gpu(e, u) for e, u in zip(given, gpu_uuids, strict=True)
    ):
        raise EngineError(
            f"engine.sglang.env.CUDA_VISIBLE_DEVICES = {value!r} contradicts gpu.devices: dvfs "
            f"pins the server to the metered GPU(s) {','.join(gpu_uuids)} by UUID; remove the key"
        )


#: What makes one server_command right for any metered GPUs, each fleet worker's its own: a
#: container passed the CUDA_VISIBLE_DEVICES dvfs hands the wrapper (`_passes_cuda_uuids`).
PASS_CUDA_UUIDS = (
    "pass the container dvfs's own CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES with --gpus "
    "all), right for each fleet worker's GPUs"
)

#: `PASS_CUDA_UUIDS` for podman, whose `--gpus all` podman 4 ignores (a no-op) and podman 5
#: reads as the CDI name `nvidia.com/gpu=all`: the CDI device, which both read.
PODMAN_PASS_CUDA_UUIDS = PASS_CUDA_UUIDS.replace("--gpus all", "--device nvidia.com/gpu=all")


def _pass_cuda_uuids(command: Sequence[str]) -> str:
    """`PASS_CUDA_UUIDS`, or podman's (`PODMAN_PASS_CUDA_UUIDS`) where podman runs the container."""
    run = _container_run(command)
    podman = run is not None and run[0].split()[0] in PODMANS
    return PODMAN_PASS_CUDA_UUIDS if podman else PASS_CUDA_UUIDS


#: The container engines whose `run` (`docker run`, `podman container run`) starts a container
#: that gets none of the environment dvfs hands it but what it is passed: `-e NAME` or `--env
#: NAME` (the host's value), podman's `--env-host` (all of it); whose `exec` runs the server in
#: a container already made, on the GPUs it was made with, passed the same way.
#: `nvidia-docker` is docker's with the NVIDIA runtime; `podman-remote` is podman's client
#: (`PODMANS`), as `podman --remote`.
CONTAINER_ENGINES = ("docker", "podman", "podman-remote", "nerdctl", "nvidia-docker")

#: podman and its remote client, whose `--gpus` podman reads (`WrapperGpus.podman`).
PODMANS = ("podman", "podman-remote")

#: Slurm's launcher, whose `--gpus` (`SLURM_GPU_OPTIONS`) is a count of GPUs Slurm picks and
#: names in the CUDA_VISIBLE_DEVICES it sets in place of dvfs's (`srun --gpus=1`): no
#: container's.
SLURM_LAUNCHER = "srun"

#: srun's options giving a job step GPUs Slurm picks (a count, `--gres=gpu:1`, `-G 1`), whose
#: CUDA_VISIBLE_DEVICES Slurm sets to them in place of dvfs's.
SLURM_GPU_OPTIONS = ("--gpus", "-G", "--gres", "--gpus-per-node", "--gpus-per-task")

#: The CDI name of an NVIDIA GPU a container runtime passes through (`podman run --device
#: nvidia.com/gpu=GPU-...`, docker's `--device` with CDI): an index, a UUID, `all`.
CDI_GPU = "nvidia.com/gpu="

#: A CDI device's name, the part after `=` (container-device-interface's parser,
#: ValidateDeviceName): a letter or digit, then letters, digits, `-`, `_`, `.`, `:`.
CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


@dataclass(frozen=True)
class WrapperGpus:
    """GPUs a server_command wrapper gives the server on its command line, in place of the
    metered GPUs' UUIDs dvfs hands it as CUDA_VISIBLE_DEVICES: its own CUDA_VISIBLE_DEVICES
    (`env CUDA_VISIBLE_DEVICES=...`, `docker run -e ...`), or a container's GPUs (docker's or
    podman's `--gpus`, `--device nvidia.com/gpu=...`, the NVIDIA_VISIBLE_DEVICES the NVIDIA
    container runtime reads), a container seeing none of dvfs's CUDA_VISIBLE_DEVICES unless
    given it (`-e CUDA_VISIBLE_DEVICES`)."""

    setting: str  # as the command line says it: "CUDA_VISIBLE_DEVICES=0", "--gpus all"
    entries: tuple[str, ...]  # the GPUs it names; () where it names none (all, a count)
    container: bool  # a container's GPUs, in no order; not CUDA's list (CUDA's order)
    #: A container passed CUDA_VISIBLE_DEVICES by UUID (`_passes_cuda_uuids`): CUDA there picks
    #: the metered GPUs among those it is given, which need only hold them.
    among: bool = False
    #: A container (`setting`: "docker run", "docker exec") passed no CUDA_VISIBLE_DEVICES and
    #: given no GPUs on its command line (`_unpassed_container`): it has those its runtime gives
    #: it (an exec's: those its container was made with).
    unpassed: bool = False
    #: Not a container's: Slurm's (`srun --gpus=1`), which picks GPUs and sets its own
    #: CUDA_VISIBLE_DEVICES to them.
    slurm: bool = False
    #: env's `-i` or `-u CUDA_VISIBLE_DEVICES` (`setting`: "env -i"), or sudo without -E,
    #: setting none after (`_dropped_by`): the server has no CUDA_VISIBLE_DEVICES, so every GPU,
    #: CUDA's first.
    dropped: bool = False
    #: ssh's or kubectl's (`setting`: "ssh HOST", "kubectl run"; `_remote`): the server runs
    #: on another host's GPUs, or in a pod on those Kubernetes picks, none pinned by dvfs.
    remote: bool = False
    #: The --env-file its setting is read from (`setting`: "CUDA_VISIBLE_DEVICES=... in
    #: --env-file FILE"); "" where the command line says it.
    filed: str = ""
    #: NVIDIA_VISIBLE_DEVICES set with no container run on the command line (`env
    #: NVIDIA_VISIBLE_DEVICES=... python ...`): CUDA does not read it, only a container
    #: runtime does (enroot's hooks/98-nvidia.sh, apptainer's --nv with nvidia-container-cli,
    #: through srun's pyxis too), as it starts a container, which server_command may start
    #: out of sight. Never refused; said where it does not name the metered GPUs by UUID.
    uncontained: bool = False
    #: podman's `--gpus` (`setting`: "--gpus VALUE"; `entries`: its comma-separated words),
    #: which podman 4 ignores (a docker option it takes as a no-op: containers/podman's
    #: cmd/podman/containers/run.go, v4) and podman 5 reads word by word as CDI names,
    #: `nvidia.com/gpu=<word>` (its pkg/specgenutil/specgen.go; libpod/util.go,
    #: gpusToCDIDevices), not docker's `device=...`: never judged, as dvfs cannot tell which
    #: podman runs.
    podman: bool = False

    @property
    def judged(self) -> bool:
        """Whether it names every GPU by UUID (as CUDA and the NVIDIA container runtime take
        one, its start too): an index counts a container's GPUs (CUDA_VISIBLE_DEVICES inside
        one), or another numbering than NVML's; `all` or a count, whichever GPUs."""
        return (
            bool(self.entries)
            and not self.podman
            and all(e.upper().startswith(("GPU-", "MIG-")) for e in self.entries)
        )

    @property
    def no_cdi_name(self) -> tuple[str, ...]:
        """podman's `--gpus` words that are no CDI device name (`device=GPU-...`, docker's
        syntax), with which podman 5 fails to start the container."""
        return tuple(e for e in self.entries if self.podman and not CDI_NAME.fullmatch(e))

    def names(self, gpu_uuids: Sequence[str]) -> bool:
        """Whether it names the metered GPUs and no other (CUDA_VISIBLE_DEVICES: in order; a
        container passed CUDA_VISIBLE_DEVICES by UUID: them, and others or not)."""
        if self.among:
            return all(any(names_gpu(e, u) for e in self.entries) for u in gpu_uuids)
        if self.uncontained:  # any metered GPUs (a fleet's, each worker's among them)
            return bool(gpu_uuids) and all(
                any(names_gpu(e, u) for u in gpu_uuids) for e in self.entries
            )
        if not self.container:
            return len(self.entries) == len(gpu_uuids) and all(
                names_gpu(e, u) for e, u in zip(self.entries, gpu_uuids, strict=True)
            )
        return all(any(names_gpu(e, u) for u in gpu_uuids) for e in self.entries) and all(
            any(names_gpu(e, u) for e in self.entries) for u in gpu_uuids
        )

    def unjudged(self, metered: str) -> str:
        """What it does, not judged, in words: "sets CUDA_VISIBLE_DEVICES=0 in place of ..."."""
        if self.uncontained:
            return (
                f"sets {self.setting} with no container run on its command line, which CUDA "
                "does not read: the server runs on the CUDA_VISIBLE_DEVICES dvfs hands it "
                f"(the metered {metered}) unless what it runs starts a container (enroot, "
                "apptainer --nv, srun's pyxis), whose runtime reads it and gives the container "
                "those GPUs, and the server fails where they lack the metered ones, which dvfs "
                "cannot check"
            )
        if self.podman:
            cdi = " ".join(f"{CDI_GPU}{e}" for e in self.entries)
            podman5 = (
                f"podman 5 reads {cdi}, no CDI name, and the container fails to start"
                if self.no_cdi_name
                else f"podman 5 gives it the CDI device(s) {cdi}"
            )
            return (
                f"gives its podman container {self.setting} rather than the metered "
                f"{metered}: podman 4 ignores --gpus, {podman5}; which podman runs, dvfs "
                "cannot check"
            )
        if self.unpassed and self.setting.endswith(" exec"):
            return (
                f"runs the server in a container made before ({self.setting}), not passed "
                "CUDA_VISIBLE_DEVICES on its command line: the server runs on the GPUs the "
                f"container was made with rather than the metered {metered}, which dvfs cannot "
                "check"
            )
        if self.unpassed:
            return (
                f"starts a container ({self.setting}) not passed CUDA_VISIBLE_DEVICES on its "
                "command line: without it the server runs on the GPUs the container runtime "
                f"gives it (with a CUDA image, all) rather than the metered {metered}, which "
                "dvfs cannot check"
            )
        if self.remote and self.setting.startswith("ssh"):
            return (
                f"runs the server through {self.setting}, which passes it none of dvfs's "
                "CUDA_VISIBLE_DEVICES: on that host, on CUDA's first GPU(s) rather than the "
                f"metered {metered}, which dvfs cannot check"
            )
        if self.remote:
            return (
                f"runs the server in a Kubernetes pod ({self.setting}), on a node and GPUs "
                f"Kubernetes picks rather than the metered {metered}, which dvfs cannot check"
            )
        if self.dropped:
            return (
                f"drops CUDA_VISIBLE_DEVICES ({self.setting}) in place of the metered "
                f"{metered}: the server then runs on CUDA's first GPU(s), which dvfs cannot check"
            )
        if self.slurm:
            return (
                f"gives {SLURM_LAUNCHER} {self.setting} in place of the metered {metered}: GPUs "
                "Slurm picks by count and names in its own CUDA_VISIBLE_DEVICES, which dvfs "
                "cannot check"
            )
        if not self.container:
            return (
                f"sets {self.setting} in place of the metered {metered}, an index dvfs cannot check"
            )
        return (
            f"gives its container {self.setting} rather than the metered {metered}: GPUs by "
            "index, count or all, which dvfs cannot check"
        )


def wrapper_gpus(campaign: Campaign) -> list[WrapperGpus]:
    """The GPUs a server_command wrapper gives the server on its command line (`WrapperGpus`),
    each way it gives them; empty where it gives none (the server runs on the UUIDs dvfs hands
    it). A list written with spaces after its commas (`env "CUDA_VISIBLE_DEVICES=GPU-a,
    GPU-b"`) is one value, not a shell line cut at its first space (`command_env`): its
    entries, stripped, are what CUDA reads. An empty one gives no GPU: the server fails. A
    container's GPUs not named by UUID are left out where it is given dvfs's own
    CUDA_VISIBLE_DEVICES (`-e CUDA_VISIBLE_DEVICES`) or the metered UUIDs: CUDA picks the
    metered UUIDs among them; named by UUID, they need only hold the metered GPUs (`among`).
    A container run given no GPUs there and none of dvfs's CUDA_VISIBLE_DEVICES is one
    (`unpassed`): it has the GPUs its runtime gives it (`--runtime=nvidia`, a CUDA image's
    NVIDIA_VISIBLE_DEVICES=all; `--device /dev/nvidia1`)."""
    command = _words([str(token) for token in server_command(campaign)])
    joined = [re.sub(r",\s+", ",", token) for token in command]
    found = []
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if name.startswith("NVIDIA") and _gpus_given(joined):
            continue  # `--gpus` sets the container's own, after `-e`'s and NV_GPU's
        run = _container_run(joined)
        if name.startswith("NVIDIA") and run is not None and run[0].endswith(" exec"):
            continue  # an exec's `-e`: the runtime gave its container GPUs as it was made
        # A container passed the host's (`-e NVIDIA_VISIBLE_DEVICES`) has the environment's
        handed = _handed(joined, campaign, name) if name.startswith("NVIDIA") else None
        value, filed, where = _server_sees(joined, name, handed)
        nv_gpu, nv_from = _nv_gpu(joined, campaign) if name.startswith("NVIDIA") else (None, "")
        if nv_gpu is not None:  # nvidia-docker's `-e NVIDIA_VISIBLE_DEVICES=...`, before ours
            run = _container_run(joined)
            after = run[1] if run is not None else len(joined)
            given = [*joined[:after], "-e", f"{name}={nv_gpu}", *joined[after:]]
            sees, filed, where = _server_sees(given, name, handed)
            value, nv_gpu = sees, (nv_gpu if sees != value else None)
        entries = tuple(v.strip() for v in (value or "").split(",") if v.strip())
        if entries:
            setting = f"{name}={value}{where}" + (f" in --env-file {filed}" if filed else "")
            setting = f"NV_GPU={nv_gpu}{nv_from}" if nv_gpu is not None else setting
            runtime = name.startswith("NVIDIA")  # a container runtime's; not CUDA's
            uncontained = runtime and _container_run(joined) is None
            found.append(
                WrapperGpus(
                    setting,
                    entries,
                    runtime and not uncontained,
                    filed=filed,
                    uncontained=uncontained,
                )
            )
    devices = []
    for index, token in enumerate(command):
        flag, equals, value = token.partition("=")
        if re.fullmatch(r"-G\w+", flag) and not equals:  # srun's `-G1`
            flag, equals, value = "-G", "=", token[2:]
        slurm = _launcher_of(command, index) == SLURM_LAUNCHER
        if flag not in ("--gpus", "--device", *(SLURM_GPU_OPTIONS if slurm else ())) or not (
            equals or index + 1 < len(command)
        ):
            continue
        value = value if equals else command[index + 1]
        if slurm and flag in SLURM_GPU_OPTIONS:
            if flag != "--gres" or "gpu" in value:
                found.append(WrapperGpus(f"{flag} {value}", (), container=False, slurm=True))
        elif flag == "--gpus" and _launcher_of(command, index) in PODMANS:
            words = _podman_gpus(value)
            found.append(WrapperGpus(f"--gpus {value}", words, container=True, podman=True))
        elif flag == "--gpus":
            found.append(WrapperGpus(f"--gpus {value}", _docker_gpus(value), container=True))
        elif value.startswith(CDI_GPU):
            devices.append(value)
    if devices:
        setting = " ".join(f"--device {d}" for d in devices)
        named = tuple(d.removeprefix(CDI_GPU) for d in devices)
        found.append(WrapperGpus(setting, named, container=True))
    unpassed = _unpassed_container(joined)
    if unpassed is not None and not any(g.container for g in found):
        found.append(WrapperGpus(unpassed, (), container=True, unpassed=True))
    dropped = _dropped_by(joined)
    if dropped is not None and _drop_reaches_server(joined, dropped[1]):
        found.append(WrapperGpus(dropped[0], (), container=False, dropped=True))
    remote = _remote(joined)
    if remote is not None:
        found.append(WrapperGpus(remote, (), container=False, remote=True))
    # A container given the CUDA_VISIBLE_DEVICES dvfs hands the wrapper (`-e
    # CUDA_VISIBLE_DEVICES`, no value), or the metered UUIDs (`-e CUDA_VISIBLE_DEVICES=GPU-...`,
    # judged above), runs the server on them among the GPUs it is given (`--gpus all`, a fleet's
    # `'"device=GPU-a,GPU-b"'`), or fails to start where they are not among them.
    # podman 5 fails to start a container given `--gpus` words that are no CDI name, passed
    # CUDA_VISIBLE_DEVICES or not.
    if not _passes_cuda_uuids(joined):
        return found
    return [
        replace(g, among=g.container) for g in found if g.judged or not g.container or g.no_cdi_name
    ]


def _gpus_given(command: Sequence[str]) -> bool:
    """Whether a container run is given GPUs by `--gpus` before its image (not `--gpus 0`,
    which gives none): the daemon appends NVIDIA_VISIBLE_DEVICES=<them> to the container's
    environment after what `-e`, `--env-file`, nvidia-docker's NV_GPU or the image set
    (moby's daemon/devices_nvidia_linux.go, injectNVIDIARuntimeHook, after
    withCommonOptions's environment in daemon/oci_linux.go), and the NVIDIA runtime hook
    reads the last of a name (nvidia-container-toolkit's internal/config/image/builder.go,
    WithEnv); through CDI, the spec's NVIDIA_VISIBLE_DEVICES=void replaces the container's
    (its pkg/nvcdi/wrapper.go). The container has the GPUs `--gpus` names, whatever
    NVIDIA_VISIBLE_DEVICES it is given. Not podman's `--gpus`, which appends none: podman 4
    ignores it (a docker option it takes as a no-op), podman 5 reads its words as CDI device
    names (`nvidia.com/gpu=<word>`), so the NVIDIA hook may read `-e`'s."""
    run = _container_run(command)
    if run is None or run[0].split()[0] in (*PODMANS, "podman-compose"):
        return False
    options = command[run[1] : _image_index(command, run[1])]
    for index, token in enumerate(options):
        flag, equals, value = token.partition("=")
        if flag != "--gpus" or not (equals or index + 1 < len(options)):
            continue
        value = (value if equals else options[index + 1]).strip("'\"")
        if value not in ("0", "count=0"):
            return True
    return False


def _image_index(command: Sequence[str], after: int) -> int:
    """The index of a container run's image, the first word after `run` (at `after`) that is
    neither an option nor an option's value: an option without `=` is taken to take the next
    word (`-v /ssh`, `-w /srv`), which is at worst the image; `len(command)` where none."""
    later, value = after, False  # the word is the value of the option before it
    while later < len(command) and (value or command[later].startswith("-")):
        word = command[later]
        value = word.startswith("-") and "=" not in word and word != "--"
        later += 1
    return later


def _nv_gpu(command: Sequence[str], campaign: Campaign) -> tuple[str | None, str]:
    """The GPUs nvidia-docker's `run` (or `create`) gives its container from NV_GPU, as it
    reaches nvidia-docker: from the environment it is handed (engine.sglang.env, dvfs's own),
    set on the command line before it (`env NV_GPU=1 nvidia-docker run`), dropped there by
    an `env -i`, `env -u NV_GPU` or a sudo resetting the environment (`_sudo_drops`: `sudo
    nvidia-docker run`, unless its sudoers keeps it); its wrapper passes docker `-e
    NVIDIA_VISIBLE_DEVICES=<NV_GPU, spaces made commas>` after `run`, before the options
    given (NVIDIA/nvidia-docker's `nvidia-docker` script); None where it is not run so, or
    NV_GPU is unset or empty. With it, where it is set, in words for the setting that names
    it: "" on the command line, " from engine.sglang.env", " from dvfs's environment"."""
    run = _container_run(command)
    if run is None or run[0] != "nvidia-docker run":
        return None, ""
    value, where = _handed(command, campaign, "NV_GPU")
    return (value.replace(" ", ","), where) if value and value.strip() else (None, "")


def _handed(command: Sequence[str], campaign: Campaign, variable: str) -> tuple[str | None, str]:
    """The value of `variable` in the environment the container engine of `command`
    (`_engine_index`) is started with: the one dvfs hands the wrapper (engine.sglang.env's,
    else dvfs's own), set on the command line before the engine (`env NAME=...`), dropped
    there by an `env -i`, `env -u NAME` or a sudo resetting the environment (`_sudo_drops`);
    None where unset. With where it is set, in words: "" on the command line, " from
    engine.sglang.env", " from dvfs's environment"."""
    import os

    from dvfs.records.session import command_env

    before = command[: _engine_index(command)]
    value = dict(campaign.engine.sglang.env).get(variable)
    where = " from engine.sglang.env"
    if value is None:
        value, where = os.environ.get(variable), " from dvfs's environment"
    for index, token in enumerate(before):
        drops = {"sudo": _sudo_drops, "env": _env_drops}.get(_program(token))
        if drops is not None and drops(before, index, variable) is not None:
            value = None
        assigned = command_env([token], keep={variable}.__contains__)
        value, where = (assigned[variable], "") if variable in assigned else (value, where)
    return value, where


#: The shells whose `-c LINE` (`bash -lc LINE`) runs a line of words: `sh -c 'docker run ...'`.
SHELLS = ("sh", "bash", "dash", "zsh", "ksh")


def _words(command: list[str]) -> list[str]:
    """`command` with each shell's `-c LINE` (`SHELLS`) replaced by the line's words, as the
    shell reads them (`sh -c 'docker run --gpus all IMG "$@"' sh`: docker, run, --gpus, ...), so the
    wrapper it runs is judged as written outside one; a line the shell could not read stays
    one word."""
    for index, token in enumerate(command[:-1]):
        if token.rsplit("/", 1)[-1] not in SHELLS:
            continue
        at = _shell_line_at(command, index)
        if at is None:
            continue
        try:
            line = shlex.split(command[at])
        except ValueError:
            continue
        line = _expanded(line, command[:index])
        return [*command[:index], *_words(line), *_words(command[at + 1 :])]
    return command


#: A shell's long options that take the next word (`bash --rcfile FILE`).
SHELL_LONG_ARGUMENT_OPTIONS = ("--rcfile", "--init-file")


def _shell_line_at(command: Sequence[str], index: int) -> int | None:
    """The index of the line the shell at `command[index]` runs where its options hold `-c`
    (`sh -c LINE`, `bash -lc LINE`, `bash -o pipefail -c LINE`): the first word after its
    options, each `o` or `O` among them taking a word of its own (`-eo pipefail`, `-O
    extglob`); None where it runs no `-c` line."""
    later, line = index + 1, False
    while later < len(command):
        option = command[later]
        if option == "--":
            later += 1
            break
        if option in SHELL_LONG_ARGUMENT_OPTIONS:
            later += 2
            continue
        if option.startswith("--") or not re.fullmatch(r"[-+][A-Za-z]+", option):
            if option.startswith("--"):
                later += 1
                continue
            break
        line = line or (option.startswith("-") and "c" in option)
        later += 1 + sum(option[1:].count(letter) for letter in "oO")
    return later if line and later < len(command) else None


#: A shell line's `$CUDA_VISIBLE_DEVICES` (`${CUDA_VISIBLE_DEVICES}`), which the shell expands.
OWN_DEVICES = re.compile(r"\$(?:CUDA_VISIBLE_DEVICES\b|\{CUDA_VISIBLE_DEVICES\})")


def _expanded(line: list[str], before: Sequence[str]) -> list[str]:
    """A shell line's words with `$CUDA_VISIBLE_DEVICES` (`OWN_DEVICES`) as the shell expands
    it: the value set before the shell (`env CUDA_VISIBLE_DEVICES=... sh -c LINE`), else the
    metered GPUs' UUIDs dvfs hands it, written as what passes a container dvfs's own (its
    value unknown here): `-e CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES` (or
    NVIDIA_VISIBLE_DEVICES=) as `-e CUDA_VISIBLE_DEVICES`, `--gpus device=$CUDA_VISIBLE_DEVICES`
    as `--gpus all -e CUDA_VISIBLE_DEVICES`; `CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES`
    elsewhere sets nothing new."""
    from dvfs.records.session import command_env

    value = command_env(before, keep=_is_cuda).get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [OWN_DEVICES.sub(lambda _: value, word) for word in line]
    own = r"(?:CUDA|NVIDIA)_VISIBLE_DEVICES=" + OWN_DEVICES.pattern
    words: list[str] = []
    for index, word in enumerate(line):
        after_e = index > 0 and line[index - 1] in ("-e", "--env")
        after_gpus = index > 0 and line[index - 1] == "--gpus"
        if re.fullmatch(own, word) and after_e:
            words.append("CUDA_VISIBLE_DEVICES")
        elif match := re.fullmatch(r"(--env=|-e)" + own, word):
            words.append(match[1] + "CUDA_VISIBLE_DEVICES")
        elif re.fullmatch("CUDA_VISIBLE_DEVICES=" + OWN_DEVICES.pattern, word):
            continue
        elif re.fullmatch("device=" + OWN_DEVICES.pattern, word) and after_gpus:
            words += ["all", "-e", "CUDA_VISIBLE_DEVICES"]
        elif re.fullmatch("--gpus=device=" + OWN_DEVICES.pattern, word):
            words += ["--gpus=all", "-e", "CUDA_VISIBLE_DEVICES"]
        else:
            words.append(word)
    return words


def _server_sees(
    command: Sequence[str], name: str, handed: tuple[str | None, str] | None = None
) -> tuple[str | None, str, str]:
    """The value of `name` the wrapper's command line gives the server, None where it sets none
    (it has dvfs's, or a container none): outside a container the last set (`command_env`);
    for a container run, what it is given (`-e NAME=VALUE`; CUDA_VISIBLE_DEVICES set inside
    it too, `IMG env NAME=...`, but not NVIDIA_VISIBLE_DEVICES, which the NVIDIA runtime
    reads as the container starts), else the host's, set before the run, only where it is
    passed that (`-e NAME`, `--env-host`): `env NAME=... docker run` gives the container none
    of it. The host's is `handed` (`_handed`: with where it is set) where given, else what
    the command line sets before the run. With it, the --env-file it is read from ("" where
    none), and where the host's is set (`_handed`'s words; "" for what the run sets)."""
    from dvfs.records.session import command_env

    def keep(key: str) -> bool:
        return key == name

    run = _container_run(command)
    if run is None:
        return command_env(command, keep=keep).get(name), "", ""
    start, after = _engine_index(command), run[1]
    rest = command[after:]
    # `IMG env NAME=...` sets it inside: CUDA_VISIBLE_DEVICES for CUDA there, but never the
    # container's GPUs, which the NVIDIA runtime gave it from its environment at its start
    inside = command_env(_without_env_flags(rest), keep=keep)
    if name in inside and name == "CUDA_VISIBLE_DEVICES":
        return inside[name], "", ""
    host, where = handed or (command_env(command[:start], keep=keep).get(name), "")
    passed = [given.partition("=") for given in _container_env(rest, files=False)]
    passed = [given for given in passed if given[0] == name]
    if passed:  # the last `-e NAME[=VALUE]` wins, over an --env-file's too
        _, equals, value = passed[-1]
        return (value, "", "") if equals else (host, "", where)
    filed: dict[str, tuple[str | None, str]] = {}
    for path, line in _env_file_lines(rest):
        key, equals, value = line.partition("=")
        filed[key] = (value if equals else None, path)
    if name in filed and filed[name][0] is not None:
        return filed[name][0], filed[name][1], ""
    if _env_host(rest) or name in filed:  # a file's bare NAME: the host's, as `-e NAME`
        return host, "", where
    return None, "", ""


def _launcher_of(command: Sequence[str], index: int) -> str | None:
    """Whose option `command[index]` is: the nearest launcher before it, a container engine
    (`CONTAINER_ENGINES`) or Slurm's (`SLURM_LAUNCHER`); None where neither comes before it.
    A word that names no program is none (`_programs`): a container's name, a network or a
    mount (`docker run --name podman`, `--network podman`, `-v /usr/bin/podman:/usr/bin/podman`)."""
    for name in reversed(_programs(command)[:index]):
        if name in (*CONTAINER_ENGINES, SLURM_LAUNCHER):
            return name
    return None


def _drop_reaches_server(command: Sequence[str], at: int) -> bool:
    """Whether dropping CUDA_VISIBLE_DEVICES at `command[at]` (`_dropped_by`) takes the server's
    away: always outside a container; before a container run, where the container is passed
    the host's (`-e CUDA_VISIBLE_DEVICES`, `--env-host`); inside it, where it is passed one at
    all. A container passed none runs on the GPUs it is given whatever drops it (judged, or
    warned of, as such)."""
    run = _container_run(command)
    if run is None:
        return True
    rest = command[run[1] :]
    given = [g.partition("=") for g in _container_env(rest)]
    if at < run[1]:
        return _env_host(rest) or any(
            key == "CUDA_VISIBLE_DEVICES" and not equals for key, equals, _ in given
        )
    return _env_host(rest) or any(key == "CUDA_VISIBLE_DEVICES" for key, _, _ in given)


def _program(token: str) -> str:
    """The program a command word names (`/usr/bin/ssh`: "ssh"); "" for a word that is an
    option's value naming none: a mount's `SRC:DST` (`-v /x:/ssh`), a setting (`--volume=...`,
    `NAME=VALUE`), or an option (`-D/srv/ssh`)."""
    if ":" in token or "=" in token or token.startswith("-"):
        return ""
    return token.rsplit("/", 1)[-1]


#: srun's options that take the next word (`-D DIR`, `--chdir DIR`): short letters (those
#: of Slurm's src/common/slurm_opt.c with a required argument), and the long names, those
#: a path or a list may follow, a value may follow as a word of its own.
SRUN_ARGUMENT_OPTIONS = "ABbCcDdeFGiJLMmNnopqrSTtWwx"
SRUN_LONG_ARGUMENT_OPTIONS = (
    "--account",
    "--chdir",
    "--constraint",
    "--container",
    "--container-image",
    "--container-mounts",
    "--container-workdir",
    "--cpus-per-task",
    "--error",
    "--exclude",
    "--gpus",
    "--gpus-per-node",
    "--gpus-per-task",
    "--gres",
    "--input",
    "--job-name",
    "--mem",
    "--nodelist",
    "--nodes",
    "--ntasks",
    "--output",
    "--partition",
    "--qos",
    "--time",
)

#: env's options that take the next word (`-C DIR`, `--chdir DIR`, `-u NAME`, `-S LINE`).
ENV_ARGUMENT_OPTIONS = "uCS"
ENV_LONG_ARGUMENT_OPTIONS = ("--unset", "--chdir", "--split-string")

#: The shell's builtins whose argument is a directory, no program (`cd /srv/ssh`).
DIRECTORY_BUILTINS = ("cd", "pushd")


def _option_values(command: Sequence[str], index: int, short: str, long: Sequence[str]) -> set[int]:
    """The indices of the words that are the values of the options of the launcher at
    `command[index]` (`srun -D /srv/ssh`: that of /srv/ssh), its options taking one where
    `short` holds its letter (`-D DIR`; none where attached, `-D/srv`) or `long` its name
    (`--chdir DIR`; none where given with `=`)."""
    values = set()
    later = index + 1
    while later < len(command) and command[later].startswith("-") and command[later] != "--":
        option = command[later]
        takes = False
        if option.startswith("--"):
            name, equals, _ = option.partition("=")
            takes = name in long and not equals
        for at, letter in enumerate("" if option.startswith("--") else option[1:], start=1):
            if letter in short:
                takes = not option[at + 1 :]  # its argument, attached or the next word
                break
        if takes and later + 1 < len(command):
            values.add(later + 1)
            later += 1
        later += 1
    return values


def _programs(command: Sequence[str]) -> list[str]:
    """The program each word of `command` names (`_program`), "" for the value of a container
    run's option before its image too, a path whose last part names a program among them
    (`docker run -v /ssh`, `--tmpfs /run/sudo`, `-w /srv/env -i`): an option without `=` is
    taken to take the next word, which is at worst the image, never the command it runs.
    `--entrypoint`'s is a program the container runs. Nor is `cd`'s argument (`cd /srv/ssh`),
    or the value of an option of srun, env or sudo (`srun -D /srv/ssh`, `env --chdir
    /srv/sudo`), or an option word (`-D/srv/ssh`)."""
    programs = [_program(token) for token in command]
    for index in range(len(command)):
        if programs[index] in DIRECTORY_BUILTINS and index + 1 < len(command):
            programs[index + 1] = ""
        taking = {
            "srun": (SRUN_ARGUMENT_OPTIONS, SRUN_LONG_ARGUMENT_OPTIONS),
            "env": (ENV_ARGUMENT_OPTIONS, ENV_LONG_ARGUMENT_OPTIONS),
            "sudo": (SUDO_ARGUMENT_OPTIONS, SUDO_LONG_ARGUMENT_OPTIONS),
        }.get(programs[index])
        for value in _option_values(command, index, *taking) if taking else ():
            programs[value] = ""
    run = _container_run(command)
    later = len(command) if run is None else run[1]
    value = False  # the word is the value of the option before it
    while later < len(command) and (value or command[later].startswith("-")):
        word = command[later]
        if word.startswith("-"):  # an option, never a value: `-it -v /ssh`
            value = "=" not in word and word not in ("--", "--entrypoint")
        else:
            programs[later], value = "", False
        later += 1
    return programs


def _dropped_by(command: Sequence[str]) -> tuple[str, int] | None:
    """The env or sudo that drops the CUDA_VISIBLE_DEVICES dvfs hands the wrapper, in words
    ("env -i", "env -u CUDA_VISIBLE_DEVICES", `_sudo_drops`'s), and its index: env's `-i` (`-`,
    `--ignore-environment`) or `-u CUDA_VISIBLE_DEVICES` (`--unset`), sudo without -E, with no
    CUDA_VISIBLE_DEVICES set after it (`env -i CUDA_VISIBLE_DEVICES=GPU-...`, judged as set);
    None where none drops it."""
    from dvfs.records.session import command_env

    programs = _programs(command)
    for index, program in enumerate(programs):
        said = _sudo_drops(command, index) if program == "sudo" else None
        if said is not None and not command_env(
            command[index + 1 :], keep={"CUDA_VISIBLE_DEVICES"}.__contains__
        ):
            return said, index
        if program != "env":
            continue
        said = _env_drops(command, index, "CUDA_VISIBLE_DEVICES")
        if said is not None and not command_env(
            command[index + 1 :], keep={"CUDA_VISIBLE_DEVICES"}.__contains__
        ):
            return said, index
    return None


def _env_drops(command: Sequence[str], index: int, variable: str) -> str | None:
    """What the env at `command[index]` drops `variable` by, in words ("env -i", "env -u
    NAME"): its `-i` (`-`, `--ignore-environment`) or `-u NAME` (`--unset`); None where its
    options drop neither (a NAME=VALUE after them may set it again)."""
    said = None
    later = index + 1
    while later < len(command) and command[later].startswith("-") and command[later] != "--":
        option = command[later]
        name, equals, given = option.partition("=")
        if option in ("-", "--ignore-environment") or re.fullmatch(r"-[0v]*i\w*", option):
            said = said or "env -i"
        elif option in ("-u", "--unset") and later + 1 < len(command):
            later += 1
            if command[later] == variable:
                said = said or f"env {option} {variable}"
        elif (name == "--unset" and equals and given == variable) or (option == f"-u{variable}"):
            said = said or f"env {option}"
        elif option in ("-C", "--chdir") or re.fullmatch(r"-[0v]*S", option):
            later += 1  # its argument; an -S line is read as env's only by `command_env`
        later += 1
    return said


#: ssh's options that take the next argument (`-p PORT`, `-i KEY`): the host is the first word
#: that is neither an option nor one's argument.
SSH_ARGUMENT_OPTIONS = "BbcDEeFIiJLlmOoPpQRSWw"


def _remote(command: Sequence[str]) -> str | None:
    """What runs the server off this host's GPUs dvfs pins, in words: "ssh HOST" (ssh passes
    on no environment, so the server there has no CUDA_VISIBLE_DEVICES unless the line sets
    it after the host: `ssh HOST env CUDA_VISIBLE_DEVICES=GPU-...`, judged as set), "kubectl
    run" or "kubectl exec" (a pod on the node and GPUs Kubernetes picks). Warned of, not
    refused: dvfs refuses what surely names other GPUs, and HOST may be this one (`localhost`,
    its own name, an alias). None where neither runs it."""
    from dvfs.records.session import command_env

    for index, name in enumerate(_programs(command)):
        if name == "kubectl":
            value = False  # the word may be the value of the option before it (`-n NS`)
            for word in command[index + 1 :]:
                if word in ("run", "exec"):
                    return f"kubectl {word}"
                if not (word.startswith("-") or value):
                    break
                value = word.startswith("-") and "=" not in word
        if name != "ssh":
            continue
        later = index + 1
        while later < len(command) and command[later].startswith("-"):
            option = command[later]
            # the first letter taking an argument takes the rest, or the next word
            at = next((i for i, c in enumerate(option) if c in SSH_ARGUMENT_OPTIONS), None)
            later += 2 if at == len(option) - 1 else 1
        if later >= len(command):
            return None
        if command_env(command[later + 1 :], keep={"CUDA_VISIBLE_DEVICES"}.__contains__):
            return None
        return f"ssh {command[later]}"
    return None


#: sudo's options that take the next argument (`-u USER`), short and long (`--user USER`):
#: those of sudo_short_opts and long_opts with a required argument (sudo's src/parse_args.c).
SUDO_ARGUMENT_OPTIONS = "ugCDprtTUcaR"
SUDO_LONG_ARGUMENT_OPTIONS = (
    "--user",
    "--group",
    "--close-from",
    "--chdir",
    "--host",
    "--prompt",
    "--role",
    "--type",
    "--command-timeout",
    "--other-user",
    "--login-class",
    "--chroot",
    "--auth-type",
)


#: What `_sudo_drops` says of a sudo whose `-i` (`--login`) runs the server in a login shell,
#: whose environment sudo initialises (sudoers(5): "regardless of the value of env_reset"),
#: keeping only what its sudoers' env_keep names and what `--preserve-env=LIST` names: sudo
#: passes those on as variables set on its command line (`sudo NAME=VALUE`), set after -i
#: initialises it (sudo's parse_args.c; "sudo -i" with --preserve-env=VARIABLE is fixed in
#: sudo 1.8.24, its NEWS). With -E sudo runs nothing (`_sudo_refuses`).
SUDO_LOGIN = "sudo -i, a login shell resetting the environment"


def _sudo_drops(
    command: Sequence[str], index: int, variable: str = "CUDA_VISIBLE_DEVICES"
) -> str | None:
    """ "sudo without -E" where the sudo at `command[index]` resets the environment, as it does
    unless told to keep `variable` (`-E`, `--preserve-env`, `--preserve-env=...,VARIABLE`)
    or its sudoers does (`env_keep`, which dvfs does not read); `SUDO_LOGIN` where its `-i`
    (`--login`) resets it, unless `--preserve-env=...,VARIABLE` keeps it; None where it
    keeps it."""
    whole, listed, login = _sudo_options(command, index, variable)
    if login and not listed:
        return f"{SUDO_LOGIN}, unless its sudoers keeps it"
    return None if whole or listed else "sudo without -E, unless its sudoers keeps it"


def _sudo_options(
    command: Sequence[str], index: int, variable: str = "CUDA_VISIBLE_DEVICES"
) -> tuple[bool, bool, bool]:
    """What the sudo at `command[index]` is told: to keep the whole environment (`-E`,
    `--preserve-env`), to keep `variable` by name (`--preserve-env=...,CUDA_VISIBLE_DEVICES`),
    to run a login shell (`-i`, `--login`)."""
    later = index + 1
    whole = listed = login = False
    while later < len(command) and command[later].startswith("-") and command[later] != "--":
        option = command[later]
        name, equals, given = option.partition("=")
        whole = whole or option == "--preserve-env"
        if name == "--preserve-env" and variable in given.split(","):
            listed = True
        login = login or option == "--login"
        if option.startswith("--"):
            later += 2 if name in SUDO_LONG_ARGUMENT_OPTIONS and not equals else 1
            continue
        for at, letter in enumerate(option[1:], start=1):
            whole = whole or letter == "E"
            login = login or letter == "i"
            if letter in SUDO_ARGUMENT_OPTIONS:
                later += 0 if option[at + 1 :] else 1  # its argument, attached or the next
                break
        later += 1
    return whole, listed, login


def _sudo_refuses(command: Sequence[str]) -> bool:
    """Whether a sudo in `command` is given -i and -E together (`sudo -iE`, `-E --login`),
    with which sudo runs nothing: "you may not specify both the -i and -E options" (sudo's
    parse_args.c), its usage, exit 1."""
    for index, program in enumerate(_programs(command)):
        whole, _, login = _sudo_options(command, index) if program == "sudo" else (0, 0, 0)
        if whole and login:
            return True
    return False


def _passes_cuda_uuids(command: Sequence[str]) -> bool:
    """Whether a container is passed CUDA_VISIBLE_DEVICES by UUID: dvfs's own (`-e
    CUDA_VISIBLE_DEVICES`, `--env=...`, `-eCUDA_VISIBLE_DEVICES`, no value; podman's
    `--env-host`, the whole environment) or one naming every GPU by UUID (`-e
    CUDA_VISIBLE_DEVICES=GPU-...`, or set so inside it: `IMG env CUDA_VISIBLE_DEVICES=GPU-...`)."""
    from dvfs.records.session import command_env

    if _env_host(command):
        return True
    run = _container_run(command)
    inside = None if run is None else command_env(command[run[1] :], keep=_is_cuda)
    if inside and _by_uuid(inside["CUDA_VISIBLE_DEVICES"]):
        return True
    for given in _container_env(command):
        key, equals, value = given.partition("=")
        entries = [v.strip() for v in value.split(",") if v.strip()]
        if key == "CUDA_VISIBLE_DEVICES" and (
            not equals or (entries and all(e.upper().startswith(("GPU-", "MIG-")) for e in entries))
        ):
            return True
    return False


def _is_cuda(name: str) -> bool:
    return name == "CUDA_VISIBLE_DEVICES"


def _by_uuid(value: str) -> bool:
    """Whether a GPU list names at least one GPU, each by UUID (or a UUID's start)."""
    entries = [v.strip() for v in value.split(",") if v.strip()]
    return bool(entries) and all(e.upper().startswith(("GPU-", "MIG-")) for e in entries)


def _container_env(command: Sequence[str], *, files: bool = True) -> list[str]:
    """What `-e`/`--env` pass a container: "NAME" (the host's value) or "NAME=VALUE"; an
    `--env-file`'s lines first (`_env_files`; not where `files` is False), as `-e` wins over
    them."""
    found = _env_files(command) if files else []
    for index, token in enumerate(command):
        if index and command[index - 1] in ("-e", "--env"):
            found.append(token)
        elif token.startswith("--env="):
            found.append(token.removeprefix("--env="))
        elif token.startswith("-e") and token != "-e":  # `-eNAME`
            found.append(token.removeprefix("-e"))
    return found


def _without_env_flags(command: Sequence[str]) -> list[str]:
    """`command` without what `_container_env` reads as `-e`/`--env` flags (`-e NAME=VALUE`,
    `--env=...`, `-eNAME`): what is left sets variables inside the container."""
    kept: list[str] = []
    skip = False
    for token in command:
        if skip:
            skip = False
        elif token in ("-e", "--env"):
            skip = True
        elif not (token.startswith("--env=") or (token.startswith("-e") and token != "-e")):
            kept.append(token)
    return kept


def _env_files(command: Sequence[str]) -> list[str]:
    """The variables each `--env-file FILE` (`--env-file=FILE`) passes a container, as docker
    reads one: a line "NAME=VALUE" (VALUE as written) or "NAME" (the host's value), blank
    lines and `#` comments skipped; none from a file dvfs cannot read (from the folder it
    runs in, as the wrapper it starts)."""
    return [line for _, line in _env_file_lines(command)]


def _env_file_lines(command: Sequence[str]) -> list[tuple[str, str]]:
    """`_env_files`, each line with the FILE it is read from, as written."""
    found = []
    for index, token in enumerate(command):
        flag, equals, value = token.partition("=")
        if flag != "--env-file" or not (equals or index + 1 < len(command)):
            continue
        path = value if equals else command[index + 1]
        text = _read_env_file(Path(path))
        if text is None:
            continue
        for line in text.splitlines():
            line = line.lstrip()
            if line and not line.startswith("#"):
                found.append((path, line))
    return found


def _read_env_file(path: Path) -> str | None:
    """An `--env-file`'s text as docker reads it (bytes not UTF-8 replaced), or None where it
    cannot be read: missing, unreadable, more than a settings file's bound (/dev/zero was read
    until memory ran out), or no regular file (a FIFO was waited on for ever, and what dvfs
    read of it the container would not get)."""
    from dvfs.inputs import MAX_SETTINGS_BYTES, read_limited

    def regular_only(opened: Path, info: os.stat_result) -> None:
        if not stat.S_ISREG(info.st_mode):
            raise EngineError(f"{opened} is no regular file")

    try:
        data = read_limited(path, MAX_SETTINGS_BYTES, EngineError, "env file", regular_only)
    except (OSError, EngineError):
        return None
    return data.decode("utf-8", errors="replace")


def _env_host(command: Sequence[str]) -> bool:
    """Whether podman's `--env-host` passes its container the whole environment dvfs hands it."""
    return any(token in ("--env-host", "--env-host=true") for token in command)


#: Compose's own launchers, whose `run` starts a service's container as `docker compose run`
#: does: given the environment its compose file names, which dvfs does not read.
COMPOSE_LAUNCHERS = ("docker-compose", "podman-compose")


def _container_run(command: Sequence[str]) -> tuple[str, int] | None:
    """A container engine's `run` in command (`docker run`, `podman --remote container run`,
    `sudo docker run`, a service's: `docker compose -f FILE run`, `docker-compose run`): its
    words ("docker run", "docker compose run"; "docker exec" where it runs the server in a
    container made before) and the index of what follows `run`; None where
    there is none."""
    for index in range(len(command)):
        found = _container_run_from(command, index)
        if found is not None:
            return found
    return None


def _engine_index(command: Sequence[str]) -> int:
    """The index of the container engine whose run `_container_run` finds (0 where none)."""
    return next((i for i in range(len(command)) if _container_run_from(command, i) is not None), 0)


def _container_run_from(command: Sequence[str], index: int) -> tuple[str, int] | None:
    """`_container_run` of the container engine at `command[index]`: None where it is none, or
    is not followed by its `run`."""
    engine = command[index].rsplit("/", 1)[-1]
    if engine not in (*CONTAINER_ENGINES, *COMPOSE_LAUNCHERS):
        return None
    words = [engine]
    value = False  # the word may be the value of the option before it
    for later in range(index + 1, len(command)):
        word = command[later]
        if word in ("run", "exec"):
            return " ".join([*words, word]), later + 1
        if word.startswith("-"):
            value = "=" not in word
        elif word in ("container", "compose") or value:
            words += [word] if word == "compose" and not value else []
            value = False
        else:
            return None
    return None


def _unpassed_container(command: Sequence[str]) -> str | None:
    """The container run ("docker run") that is given no CUDA_VISIBLE_DEVICES on the command
    line: not passed it (`-e CUDA_VISIBLE_DEVICES`, with a value or none; `--env-host`), nor
    setting it inside (`IMG env CUDA_VISIBLE_DEVICES=...`), so it has none of dvfs's; None
    where there is no such container."""
    from dvfs.records.session import command_env

    run = _container_run(command)
    if run is None:
        return None
    words, after = run
    rest = command[after:]
    passed = _env_host(rest) or any(
        given.partition("=")[0] == "CUDA_VISIBLE_DEVICES" for given in _container_env(rest)
    )
    if passed or command_env(rest, keep={"CUDA_VISIBLE_DEVICES"}.__contains__):
        return None
    return words


def _podman_gpus(value: str) -> tuple[str, ...]:
    """The words of podman's `--gpus VALUE`, a CSV record as its string slice flag reads it
    (`GPU-a,GPU-b`: two; `'"device=GPU-a,GPU-b"'`: one); () where it cannot be read."""
    try:
        return tuple(v.strip() for v in next(csv.reader([value])) if v.strip())
    except (csv.Error, StopIteration):
        return ()


def _docker_gpus(value: str) -> tuple[str, ...]:
    """The GPUs docker's `--gpus VALUE` names (a CSV record, as docker reads it: `device=0`,
    `'"device=GPU-a,GPU-b"'`); () where it names them by count (`all`, `2`, `count=2`, none
    said: one), or cannot be read."""
    try:
        fields = next(csv.reader([value]))
    except (csv.Error, StopIteration):
        return ()
    named: tuple[str, ...] = ()
    for field in fields:
        key, equals, given = field.partition("=")
        if not equals or key == "count":
            return ()
        if key == "device":
            named = tuple(v.strip() for v in given.split(",") if v.strip())
    return named


def check_wrapper_visible_devices(campaign: Campaign, gpu_uuids: Sequence[str]) -> None:
    """Refuse a server_command whose wrapper gives the server GPUs named by UUID other than
    the metered ones (`wrapper_gpus`): `env CUDA_VISIBLE_DEVICES=GPU-...`, which replaces the
    UUIDs dvfs hands the wrapper, or a container's (`docker run --gpus device=GPU-...`), so
    the server would run on GPUs dvfs does not meter (caught at start only where NVML lists
    its processes, which a container's are not: they are no child of dvfs's). A UUID may be
    written short, as CUDA takes a prefix naming one GPU (`dvfs.gpu.visible`). An index,
    `all` or a count is not judged (`unjudged_wrapper_devices`). A sudo given -i and -E
    together, which runs nothing (`_sudo_refuses`), is refused too."""
    metered = ",".join(gpu_uuids)
    words = _words([str(token) for token in server_command(campaign)])
    if _sudo_refuses(words):
        raise EngineError(
            "engine.sglang.server_command gives sudo -i and -E together, with which sudo runs "
            'nothing ("you may not specify both the -i and -E options"): the server would '
            "not start; give sudo --preserve-env=CUDA_VISIBLE_DEVICES in place of -E, which "
            "keeps the CUDA_VISIBLE_DEVICES dvfs hands the server with -i too"
        )
    for given in wrapper_gpus(campaign):
        if not given.judged or given.names(gpu_uuids) or given.uncontained:
            continue
        if not given.container:
            raise EngineError(
                f"engine.sglang.server_command sets {given.setting}, other GPUs than "
                f"the metered {metered}: the server would run where dvfs does not "
                f"meter; remove it from {'that --env-file' if given.filed else 'server_command'} "
                "(dvfs pins the server to the metered GPUs by UUID)"
            )
        if given.among:
            raise EngineError(
                f"engine.sglang.server_command gives its container {given.setting}, without "
                f"the metered {metered} that the CUDA_VISIBLE_DEVICES it is passed names: the "
                f"server cannot start there; give the container the metered GPU(s) too "
                f"({metered})"
            )
        unset = "unset NV_GPU and " if given.setting.startswith("NV_GPU=") else ""
        if given.setting.endswith(("from engine.sglang.env", "from dvfs's environment")):
            unset = unset or "pass it no NVIDIA_VISIBLE_DEVICES and "
        raise EngineError(
            f"engine.sglang.server_command gives its container {given.setting}, other GPUs "
            f"than the metered {metered}: the server would run where dvfs does not meter; "
            f"give it the metered GPU(s) by UUID instead ({metered}), or {unset}"
            f"{_pass_cuda_uuids(words)}"
        )


def _unjudged(campaign: Campaign, gpu_uuids: Sequence[str]) -> list[WrapperGpus]:
    """What `unjudged_wrapper_devices` says (`wrapper_gpus`): those not named by UUID, and an
    NVIDIA_VISIBLE_DEVICES with no container (`uncontained`) not naming the metered
    `gpu_uuids` (any, where none are given)."""
    return [
        g
        for g in wrapper_gpus(campaign)
        if not g.judged or (g.uncontained and not g.names(gpu_uuids))
    ]


def unjudged_wrapper_devices(
    campaign: Campaign, metered: str = "GPUs' UUIDs", gpu_uuids: Sequence[str] = ()
) -> str | None:
    """What a server_command wrapper gives the server in place of the metered GPUs where
    `check_wrapper_visible_devices` cannot judge it (`wrapper_gpus` not named by UUID: an
    index, which inside a container counts the container's GPUs, on this host NVML's or
    CUDA's; a container's `all` or count), in words ("engine.sglang.server_command sets
    CUDA_VISIBLE_DEVICES=0 in place of the metered GPU-..., an index dvfs cannot check"),
    and an NVIDIA_VISIBLE_DEVICES with no container not naming the metered `gpu_uuids`
    (`_unjudged`); None where it gives none, or only GPUs judged."""
    said = [g.unjudged(metered) for g in _unjudged(campaign, gpu_uuids)]
    return "engine.sglang.server_command " + " and ".join(said) if said else None


def pinned_by(campaign: Campaign) -> str:
    """What pins the server to the metered GPUs, in words, where `check_wrapper_visible_devices`
    passes it and `unjudged_wrapper_devices` says nothing: CUDA_VISIBLE_DEVICES (not for a
    container given none, `_unpassed_container`, which never receives it) and each container
    setting (`wrapper_gpus`): "CUDA_VISIBLE_DEVICES; the container's --gpus device=GPU-..."."""
    words = _words([str(token) for token in server_command(campaign)])
    command = [re.sub(r",\s+", ",", token) for token in words]
    by = [] if _unpassed_container(command) else ["CUDA_VISIBLE_DEVICES"]
    by += [
        f"the container's {g.setting}"
        for g in wrapper_gpus(campaign)
        if g.container and not g.unpassed
    ]
    return "; ".join(by)


def unjudged_remedy(campaign: Campaign, gpu_uuids: Sequence[str] = ()) -> str:
    """What to do about what `unjudged_wrapper_devices` says, for doctor's warning: a container
    given nothing but its runtime's GPUs needs only be passed dvfs's CUDA_VISIBLE_DEVICES."""
    unjudged = _unjudged(campaign, gpu_uuids)
    pass_cuda = _pass_cuda_uuids(_words([str(token) for token in server_command(campaign)]))
    if unjudged and all(g.uncontained for g in unjudged):
        return (
            "remove NVIDIA_VISIBLE_DEVICES from server_command, or name the metered GPUs there "
            "by UUID: outside a container dvfs pins the server by CUDA_VISIBLE_DEVICES"
        )
    if unjudged and all(g.podman for g in unjudged):
        return (
            "give podman --device nvidia.com/gpu=<UUID> of each metered GPU in place of --gpus "
            "(CDI, read by podman 4 and 5), or pass the container dvfs's own "
            "CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES with --device nvidia.com/gpu=all), "
            "right for each fleet worker's GPUs"
        )
    if unjudged and all(g.unpassed for g in unjudged):
        if any(g.setting.endswith(" exec") for g in unjudged):
            return (
                "pass it dvfs's own CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES after exec), "
                "the container made with the metered GPUs (or --gpus all)"
            )
        if any(" compose" in g.setting or "-compose" in g.setting for g in unjudged):
            # Compose's `run` takes `-e` but no `--gpus`: its compose file reserves the GPUs.
            return (
                "pass the container dvfs's own CUDA_VISIBLE_DEVICES (-e CUDA_VISIBLE_DEVICES after "
                "run, the compose file reserving it every GPU), right for each fleet worker's GPUs"
            )
        return pass_cuda
    if unjudged and all(g.dropped and g.setting.startswith(SUDO_LOGIN) for g in unjudged):
        return (
            "give sudo --preserve-env=CUDA_VISIBLE_DEVICES, which keeps the CUDA_VISIBLE_DEVICES "
            "dvfs hands the server with -i too (or -E in place of -i)"
        )
    if unjudged and all(g.dropped and g.setting.startswith("sudo") for g in unjudged):
        return (
            "give sudo -E (or --preserve-env=CUDA_VISIBLE_DEVICES), which keeps the "
            "CUDA_VISIBLE_DEVICES dvfs hands the server"
        )
    if unjudged and all(g.dropped for g in unjudged):
        return (
            "remove it from server_command: dvfs hands the server CUDA_VISIBLE_DEVICES = the "
            "metered GPUs' UUIDs"
        )
    if unjudged and all(g.remote and g.setting.startswith("ssh") for g in unjudged):
        return (
            "run dvfs itself on the host that serves, whose GPUs it then meters and pins the "
            "server to, and drop ssh from server_command"
        )
    if unjudged and all(g.remote for g in unjudged):
        return "run dvfs itself in the pod, which starts the server on the metered GPUs"
    if unjudged and all(g.slurm for g in unjudged):
        return (
            f"drop {SLURM_LAUNCHER} from server_command and run dvfs itself in the Slurm job, "
            "which starts the server on the metered GPUs"
        )
    return (
        f"name the metered GPUs there by UUID, or {pass_cuda}, or outside a container "
        "remove it from server_command"
    )
