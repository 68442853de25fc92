"""The one place that picks backends: twin or NVML GPUs, virtual or real time, twin or SGLang.

Everything else (the sweep, `dvfs gpu`, `dvfs cap`, `dvfs doctor`, the dry-run plan) asks this
module for opened backends or for what a backend would do, and receives them as arguments.
Heavy imports stay inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dvfs.errors import (
    CampaignError,
    GpuError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
)
from dvfs.gpu.visible import SWEEP_NAMING, Visible
from dvfs.redact import redact_argv

if TYPE_CHECKING:
    from dvfs.campaign import Campaign
    from dvfs.clock import Clock
    from dvfs.corpora.model import Corpus
    from dvfs.engines.base import Engine
    from dvfs.engines.sglang_args import LaunchHelp
    from dvfs.gpu.base import Gpu
    from dvfs.twin.drafting import DraftPlan
    from dvfs.twin.profiles import GpuProfile, ModelProfile
    from dvfs.twin.textprior import TextProfile


@dataclass
class Backends:
    """What a run needs from the outside world, opened together."""

    clock: Clock
    gpus: list[Gpu]
    engine: Engine


def parse_devices(devices: Sequence[str]) -> list[int | str]:
    """Device names from a command line: digits are indices, anything else a UUID (in NVML's
    case: `dvfs.gpu.base.canonical_uuid`)."""
    from dvfs.gpu.base import canonical_uuid

    return [int(d) if d.isdigit() else canonical_uuid(d) for d in devices]


def real_gpus(campaign: Campaign) -> bool:
    """Whether the campaign changes real GPUs (state files, locks and root apply), not twins."""
    return campaign.gpu.backend == "nvml"


def simulated_engine(campaign: Campaign) -> bool:
    """Whether the campaign's engine is the twin (no server, no tokenizer of its own)."""
    return campaign.engine.backend == "twin"


def virtual_time(campaign: Campaign) -> bool:
    """Simulated GPUs under a simulated engine live in virtual time; a real server (or a real
    GPU) sets the pace otherwise."""
    return campaign.gpu.backend == "twin" and simulated_engine(campaign)


def twin_gpus(profile_key: str, indices: Sequence[int], clock: Clock) -> list[Gpu]:
    """Simulated GPUs of one profile sharing `clock`."""
    from dvfs.gpu.twin import TwinGpu
    from dvfs.twin.device import TwinDevice
    from dvfs.twin.profiles import gpu_profile

    profile = gpu_profile(profile_key)
    return [TwinGpu(TwinDevice(profile, clock, i)) for i in indices]


@contextlib.contextmanager
def open_gpus(
    devices: Sequence[int | str],
    *,
    twin: str | None = None,
    allow_mig: bool = False,
    nvml: ModuleType | None = None,
    visible: Visible | None = None,
    lost: list[GpuError] | None = None,
) -> Iterator[list[Gpu]]:
    """GPUs by index or UUID: twins of profile `twin` in virtual time (GPU 0 when none is
    named), else real ones over NVML (every GPU when none is named), held to `visible` (see
    `job_gpus`) when a command changes or meters them; with `lost`, real GPUs that do not
    open are added to it and left out (`dvfs.gpu.nvml.open_nvml_gpus`)."""
    if twin:
        from dvfs.clock import VirtualClock

        named = [d for d in devices if not isinstance(d, int)]
        if named:
            raise CampaignError(
                f"the twin's GPUs are named by index (0, 1, ...), not by UUID: {named[0]}"
            )
        indices = [int(d) for d in devices] or [0]
        twice = next((i for n, i in enumerate(indices) if i in indices[:n]), None)
        if twice is not None:  # as NVML's GPUs refuse it: two twins would pose as one GPU
            from dvfs.gpu.nvml import GpuNamedTwiceError

            error = GpuNamedTwiceError(f"GPU {twice} is named twice: name each GPU once")
            error.twice = f"GPU {twice}"
            raise error
        yield twin_gpus(twin, indices, VirtualClock())
        return
    from dvfs.gpu.nvml import open_nvml_gpus

    with open_nvml_gpus(
        list(devices) or None, nvml=nvml, allow_mig=allow_mig, visible=visible, lost=lost
    ) as gpus:
        yield list(gpus)


def reachable_gpus(
    visible: Visible | None = None,
    *,
    nvml: ModuleType | None = None,
    read: bool = True,
    devices: Sequence[int | str] = (),
    shown: bool = False,
    unsupported_ok: bool = False,
) -> tuple[list[int | str], list[GpuError]]:
    """Every GPU (with `visible`, every one it gives the job: `dvfs.gpu.nvml.every_gpu`) as NVML
    indices, or the GPUs `devices` names (as named), split into those that open and the errors
    of those that do not (fallen off the bus, needing a reset, any other NVML error on that GPU,
    a call on it that hangs), each opened on its own, read-only, side by side (GPUs whose
    driver hangs cost one deadline in all), and closed: so that a command over every GPU or
    the GPUs named (`gpu reset`, `cap reset`, `monitor`) acts on the others, then names the
    lost ones (`lost_gpus`), in the order named. A permission refusal of a GPU named, or of every
    GPU, stops the command (exit 4), as NVML failing to start (no driver) does; so does a named
    GPU that is not on this machine at all (a typo). A GPU NVML has no permission to talk to
    while it talks to others is no GPU of this process, not in "every GPU" (`every_gpu`).

    With `read`, a GPU that opens must also read its power limit, as every such command does
    (`gpu list` shows it, `cap show` and `gpu info` too, `cap apply`, `cap reset` and `gpu reset`
    record it before a change): a GPU needing a reset may still give its UUID (the driver keeps
    it) while every reading fails, and one whose power limit NVML does not support (NOT_SUPPORTED)
    fails those commands all the same; either would otherwise stop the command on the others.
    `monitor` passes False: it exports such a GPU as not up until it answers again (a reading
    it does not support as NaN). With `shown` (`cap show`, `gpu info`), every power and clock
    reading they show is read too: one NVML does not support (the enforced power limit, the
    SM clock) failed them on that GPU after the check, showing none of the others. With
    `unsupported_ok`, a power limit NVML does not support passes, where the command reads it
    only on a GPU it changes (`gpu reset` with nothing recorded for it, `cap apply` of a file
    that does not name it, which sets aside one it names itself): that GPU, which cannot
    change, must not fail the command on every run."""
    from dvfs.gpu.knobs import side_by_side
    from dvfs.gpu.nvml import every_gpu, log_held, nvml_session, open_device, warnings_held

    named: list[int | str] = list(devices)
    # every GPU: those whose handle hung as they were listed, named as lost, not asked again
    hung: dict[int, GpuError] = {}
    # NVML itself first, named GPUs or not: a missing driver is no one GPU's loss (it was
    # said once per GPU named, as if each had fallen off the bus)
    with nvml_session(nvml) as module:
        if not named:
            named = list(every_gpu(module, visible=visible, hung=hung))
        # NVML held for the probes; each GPU opened on its own (its own NVML worker, deadline)

        def probe(entry: tuple[int, int | str]) -> tuple[GpuError | None, list[str]]:
            """Why the GPU named `entry[1]` does not open, or None where it does, with the
            warnings its opening gave (`warnings_held`: logged in the GPUs' order)."""
            with warnings_held() as held:
                return opening(entry[1]), held

        def opening(device: int | str) -> GpuError | None:
            """Why the GPU named `device` does not open, or None where it does."""
            if isinstance(device, int) and device in hung:
                return hung[device]
            try:
                gpu = open_device(module, device, allow_mig=True)
                if read:
                    try:
                        gpu.power_limit_mw()
                    except GpuNotSupportedError:
                        if not (unsupported_ok or shown):
                            raise
                        supported = False  # shown as not supported, its range too
                    else:
                        supported = True
                    if shown:
                        gpu.enforced_power_limit_mw()
                        if supported:
                            gpu.power_limit_range()
                        gpu.sm_clock_mhz()
            except GpuError as exc:
                return exc
            return None

        # Side by side (`side_by_side`, as restores are): GPUs whose driver hangs whole cost
        # one deadline in all, not one each before the command acts on any (six at 10 s: a
        # minute before `dvfs gpu reset`, the governor unit's ExecStopPost, put any back).
        # Said in the GPUs' order, whichever answers first; a Ctrl-C gives up on the rest.
        entries = list(enumerate(named))
        outcomes: dict[int, tuple[GpuError | None, list[str]]] = {}
        probing = side_by_side(entries, probe, named=lambda entry: f"probe-gpu{entry[1]}")
        with contextlib.closing(probing) as finishing:
            for (position, _), outcome in finishing:
                outcomes[position] = outcome
    openable: list[int | str] = []
    failed: list[tuple[int | str, GpuError]] = []
    for position, device in entries:
        exc, warned = outcomes[position]
        log_held(warned)
        if exc is None:
            openable.append(device)
            continue
        if isinstance(exc, GpuPermissionError):
            raise exc
        if devices and isinstance(exc, GpuNotFoundError):
            raise exc  # no such GPU here at all: a typo, not a lost GPU
        exc.index = device if isinstance(device, int) else None
        exc.uuid = device if isinstance(device, str) else None
        failed.append((device, exc))
    if any(exc.index is None for _, exc in failed):
        _lost_indices([exc for _, exc in failed], nvml)
    return openable, _named_once(failed)


class WithheldGpus:
    """The GPUs NVML counts but has no permission to talk to, which every GPU (without
    CUDA_VISIBLE_DEVICES) leaves out (`dvfs.gpu.nvml.refused_gpus`), asked of NVML once
    however many of a command's lines need them (`gpu reset --defaults` asked for its state
    files' line, then again for its caps'). A GPU of `lost` (those `reachable_gpus` could not
    open) whose call hung is not asked again (`known_hung`): asked, its handle cost one NVML
    deadline more (`monitor`, `cap apply`)."""

    def __init__(self, lost: Sequence[GpuError] = (), nvml: ModuleType | None = None) -> None:
        from dvfs.gpu.deadline import GpuTimeoutError

        self.hung = [
            e.index for e in lost if e.index is not None and isinstance(e, GpuTimeoutError)
        ]
        self.nvml = nvml
        self._refused: list[int] | None = None

    def __call__(self) -> list[int]:
        if self._refused is None:
            from dvfs.gpu.nvml import nvml_session, refused_gpus

            with nvml_session(self.nvml) as module:
                self._refused = refused_gpus(module, hung=self.hung)
        return list(self._refused)


def withheld_gpus(nvml: ModuleType | None = None, *, lost: Sequence[GpuError] = ()) -> list[int]:
    """The GPUs NVML counts but has no permission to talk to, which every GPU (without
    CUDA_VISIBLE_DEVICES) leaves out (`WithheldGpus`, a GPU of `lost` whose call hung not asked
    again): a command over every GPU that must not quietly act on fewer names them."""
    return WithheldGpus(lost, nvml)()


def withheld_records_line(
    records: Sequence[str],
    holds: str,
    left: str,
    command: str,
    lost: Sequence[GpuError] = (),
    withheld: WithheldGpus | None = None,
) -> str:
    """The line for records (`holds` them: state files, caps) of GPUs none of those a command
    over every GPU opened, where NVML withholds GPUs from this process (such records may be
    theirs): what was `left` undone, and to rerun `command` as a user the GPUs admit. "" where
    there are no such records or NVML withholds none. A record of a GPU of `lost` (those that
    did not open, `reachable_gpus`) whose UUID NVML still reads is that GPU's, named with
    those lost: not here too, with a sudo that would not help it (one GPU, two lines of
    advice). (A GPU whose calls hang is not asked again: a deadline more; its record stays
    here, as one whose UUID NVML cannot read.) `withheld`: the command's `WithheldGpus`, asked
    once for all its lines (by default, one of `lost`'s own)."""
    if not records:
        return ""
    from dvfs.gpu.deadline import GpuTimeoutError
    from dvfs.gpu.nvml import nvml_session, uuids_of

    # a GPU whose calls hung is not asked again (`WithheldGpus`): a deadline more
    refused = (withheld or WithheldGpus(lost))()
    if not refused:
        return ""
    answering = [
        e.index for e in lost if e.index is not None and not isinstance(e, GpuTimeoutError)
    ]
    theirs: set[str] = set()
    if answering:
        with nvml_session() as module:
            theirs = set(uuids_of(module, answering))
    records = [r for r in records if r not in theirs]
    if not records:
        return ""
    named = ", ".join(f"GPU {i}" for i in refused)
    # A GPU whose calls hung: its UUID unread, a record may be its, which sudo cannot help
    # (one GPU, one advice: the reset once it answers, with the withheld GPUs' as root).
    hung = [e.index for e in lost if e.index is not None and isinstance(e, GpuTimeoutError)]
    if hung:
        which = ", ".join(f"GPU {i}" for i in hung)
        return (
            f"{holds} {', '.join(records)}, none of the GPUs this process opened: they may be "
            f"of {named} (the driver does not let it talk to them; NVML: no permission) or of "
            f"{which} (its calls did not return), so {left}; once {which} answers again, run "
            f"{command} as a user the GPUs admit (root, with sudo)"
        )
    return (
        f"{holds} {', '.join(records)}, none of the GPUs this process may talk to: the driver "
        f"does not let it talk to {named} (NVML: no permission), so {left}; run {command} as a "
        "user the GPUs admit (root, with sudo)"
    )


def withheld_caps_line(
    directory: Path,
    found: Sequence[Gpu],
    left: str,
    command: str,
    lost: Sequence[GpuError] = (),
    withheld: WithheldGpus | None = None,
) -> str:
    """The line naming the GPUs dvfs's caps record (in `directory`) holds caps for that none of
    `found` (every GPU a reset took) is, where NVML counts GPUs it has no permission to talk to
    (every GPU leaves them out, their UUIDs unreadable: such caps may be one's, left in force):
    `withheld_records_line`; "" where there are none (a damaged record: the reset said what it
    could)."""
    from dvfs.caps import AppliedCaps
    from dvfs.errors import CapsError

    try:
        recorded = AppliedCaps(directory).read()
    except CapsError:
        return ""
    opened = {g.identity.uuid for g in found}
    others = [uuid for uuid in recorded if uuid not in opened]
    return withheld_records_line(
        others, "dvfs's caps record holds caps for", left, command, lost, withheld
    )


def _lost_indices(lost: Sequence[GpuError], nvml: ModuleType | None) -> None:
    """Give each GPU of `lost` named by UUID its NVML index where it is knowable: the GPU whose
    UUID is that one, or, where no readable UUID is, the only GPU whose UUID NVML cannot read
    (the rule CUDA_VISIBLE_DEVICES is read by, `dvfs.gpu.visible.resolve`). Left unknown where
    two or more GPUs' UUIDs cannot be read, or NVML cannot list them."""
    from dvfs.gpu.nvml import machine_uuids, nvml_session
    from dvfs.gpu.visible import resolve

    try:
        with nvml_session(nvml) as module:
            uuids = machine_uuids(module)
    except GpuError:
        return
    for exc in lost:
        if exc.index is None and exc.uuid:
            try:
                found = resolve(exc.uuid, uuids)
            except CampaignError:  # not a GPU's UUID (MIG-...): its index stays unknown
                continue
            if len(found.indices) == 1 and found.stopped_at is None:
                exc.index = found.indices[0]


def _named_once(failed: Sequence[tuple[int | str, GpuError]]) -> list[GpuError]:
    """The errors of the named GPUs that did not open, refusing (`GpuNamedTwiceError`, exit 2,
    as a GPU that opens named twice is) one named twice: by the same name, or by its index and
    its UUID where that is knowable (`_lost_indices`)."""
    from dvfs.gpu.nvml import named_twice_error

    seen: dict[int | str, int | str] = {}
    for device, exc in failed:
        key: int | str = exc.index if exc.index is not None else str(device).lower()
        if key in seen:
            shown = key if exc.index is not None else device
            raise named_twice_error(f"GPU {shown} (as {seen[key]} and {device})")
        seen[key] = device
    return [exc for _, exc in failed]


def lost_gpus(lost: Sequence[GpuError]) -> GpuError:
    """The one error (exit 1, one line) naming every GPU `reachable_gpus` could not open: GPUs
    that failed alike (the same call hung on each, each fallen off the bus) said once, as
    "GPU 0, GPU 1: what failed on each", and a hung call's advice (`NOT_RESPONDING`) once,
    after the last hung call. Each GPU's whole text, the advice in every one, made six hung
    GPUs' line overrun the bound of an error line (`MAX_MESSAGE_CHARS`), and its end, what
    to run, was cut off."""
    return lost[0] if len(lost) == 1 else GpuUnavailableError(lost_line(lost))


#: A GPU as an error's text names it by its index: "GPU 3", or "GPU 3 (GPU-...)".
_BY_INDEX = r"GPU (?P<index>{index})(?!\d)(?: \(GPU-[0-9A-Fa-f-]+\))?"


def _own_name(exc: GpuError, text: str) -> tuple[str, re.Pattern[str]] | None:
    """How `text` (`exc`'s) first names its GPU, and every way it names it (its index, the
    UUID it was named by), for `lost_line` to say "each" in their place; None where it does not
    name it. Where a GPU's index is not known (named by a UUID NVML could not match), its
    text's first "GPU N" is its (the GPU each opening names in its errors)."""
    known = None if exc.index is None else str(exc.index)
    ways = [_BY_INDEX.format(index=known or r"\d+")]
    if exc.uuid:
        ways.append(re.escape(exc.uuid))
    found = re.search("|".join(ways), text, re.IGNORECASE)
    if found is None:
        return None
    index = found.group("index") or known
    own = [] if index is None else [_BY_INDEX.format(index=index)]
    if exc.uuid:
        own.append(re.escape(exc.uuid))
    return found.group(0), re.compile("|".join(own), re.IGNORECASE)


def lost_line(lost: Sequence[GpuError]) -> str:
    """The line of `lost_gpus`: every GPU of `lost` named, in their order, those that failed
    alike in one entry (at the first of them), a hung call's advice after the last."""
    from dvfs.gpu.deadline import NOT_RESPONDING

    # what failed on each, its own name as "each" (or its whole text where that does not say
    # which GPU it is): the names of the GPUs it failed on, and the text of the first
    groups: dict[str, tuple[list[str], str]] = {}
    for number, exc in enumerate(lost):
        text = str(exc)
        named = _own_name(exc, text)
        if named is None:
            groups[f"{number}\0{text}"] = ([], text)
            continue
        name, own = named
        alike = own.sub("each", text).removeprefix("each: ")
        groups.setdefault(alike, ([], text))[0].append(name)
    said = [
        f"{', '.join(names)}: {alike}" if len(names) > 1 else text
        for alike, (names, text) in groups.items()
    ]
    advice = f"; {NOT_RESPONDING}"
    hung = [n for n, entry in enumerate(said) if entry.endswith(advice)]
    return "; ".join(
        entry.removesuffix(advice) if n in hung[:-1] else entry for n, entry in enumerate(said)
    )


def with_lost_rows(
    rows: Sequence[dict[str, Any]], lost: Sequence[GpuError]
) -> list[dict[str, Any]]:
    """A command's --json rows of the GPUs that opened, with a row `{"index", "error"}` for
    each GPU `reachable_gpus` could not open, in index order: the shape `dvfs gpu list --json`
    gives a GPU fallen off the bus."""
    missing = [{"index": e.index, "error": str(e)} for e in lost]
    return sorted([*rows, *missing], key=lambda r: -1 if r["index"] is None else r["index"])


def job_gpus(naming: str = SWEEP_NAMING) -> Visible | None:
    """This process's CUDA_VISIBLE_DEVICES (None when unset or empty): what a command that
    changes or meters real GPUs holds them to, since NVML, and so dvfs's GPU numbers, ignore it
    (`dvfs.gpu.visible`). `naming`: how the command names GPUs, for the refusal's hint. The
    twin's GPUs are no CUDA devices, so twins are never held to it."""
    return Visible.from_env(os.environ, naming)


def check_job_gpus(
    campaign: Campaign, devices: Sequence[int | str], *, nvml: ModuleType | None = None
) -> None:
    """Refuse now, before a sweep (or its dry run) touches a GPU, what opening the campaign's
    real GPUs `devices` would: one that CUDA_VISIBLE_DEVICES does not give the job
    (`job_gpus`). Nothing to check on the twin or without the variable; where NVML cannot open
    them (a laptop planning for a GPU node) the sweep's own opening tells."""
    visible = job_gpus()
    if not real_gpus(campaign) or visible is None or not devices:
        return
    with (
        contextlib.suppress(GpuError),
        open_gpus(devices, nvml=nvml, allow_mig=True, visible=visible),
    ):
        pass


def check_gpus_named_once(
    campaign: Campaign, devices: Sequence[int | str], *, option: str, nvml: ModuleType | None = None
) -> None:
    """Refuse, before a sweep (or its dry run) locks a GPU, real GPUs `devices` (from `option`:
    --gpus or gpu.devices) naming one GPU twice, by its index and its UUID (two equal entries
    the parser refuses): its two workers (or one server's two GPUs) would each lock it, and the
    second be told another dvfs holds it. Opened read-only (`open_nvml_gpus` refuses such a
    list) where a UUID is among them; where NVML cannot open them the sweep's own opening
    tells."""
    if not real_gpus(campaign) or not any(isinstance(d, str) for d in devices):
        return
    from dvfs.gpu.nvml import GpuNamedTwiceError, named_twice

    try:
        with contextlib.suppress(GpuError), open_gpus(devices, nvml=nvml, allow_mig=True):
            pass
    except GpuNamedTwiceError as exc:
        raise CampaignError(named_twice(option, exc.twice)) from None


@contextlib.contextmanager
def open_campaign_gpus(
    campaign: Campaign, clock: Clock, *, nvml: ModuleType | None = None
) -> Iterator[list[Gpu]]:
    """The GPUs a campaign names: twins on `clock`, or real GPUs (MIG refused)."""
    if campaign.gpu.backend == "twin":
        indices = []
        for device in campaign.gpu.devices:
            if not isinstance(device, int):
                raise CampaignError(f"the twin backend takes GPU indices, not {device!r}")
            indices.append(device)
        yield twin_gpus(campaign.gpu.profile or "", indices, clock)
        return
    from dvfs.gpu.nvml import open_nvml_gpus

    with open_nvml_gpus(campaign.gpu.devices, nvml=nvml, visible=job_gpus()) as gpus:
        yield list(gpus)


def acceptance_aliases(campaign: Campaign) -> dict[str, str]:
    """User corpora that tell the twin which built-in corpus they accept like."""
    aliases = {}
    for ref in campaign.workload.corpora:
        spec = dict(ref.spec or ())
        if "acceptance_like" in spec:
            aliases[ref.name] = str(spec["acceptance_like"])
    return aliases


def corpus_texts(
    campaign: Campaign, corpora: Mapping[str, Corpus] | None = None
) -> dict[str, TextProfile]:
    """What the twin reads from each corpus's text (genre, language, n-gram repetition), with
    the trained drafters' class set by `acceptance_like` where the campaign gives one.

    Reads the corpora unless given them; those that cannot be read are left out (the sweep
    and the dry run report them)."""
    from dvfs.corpora.registry import load_corpus
    from dvfs.errors import CorpusError
    from dvfs.twin.textprior import profile_corpus

    aliases = acceptance_aliases(campaign)
    texts = {}
    for ref in campaign.workload.corpora:
        spec = dict(ref.spec) if ref.spec is not None else None
        try:
            corpus = (
                corpora[ref.name]
                if corpora is not None and ref.name in corpora
                else load_corpus(ref.name, spec, base_dir=campaign.base_dir)
            )
        except CorpusError:
            continue
        text = profile_corpus(corpus)
        texts[ref.name] = text.overridden(aliases[ref.name]) if ref.name in aliases else text
    return texts


def _twin_node(campaign: Campaign, gpus: list[Gpu], clock: Clock) -> Any:
    """What the twin engine runs on: the twin GPUs themselves, or a free-running model of
    real GPUs (`free_running_profile`)."""
    from dvfs.gpu.twin import TwinGpu
    from dvfs.twin.device import FreeRunningNode, TwinNode

    if campaign.gpu.backend == "twin":
        return TwinNode([g.device for g in gpus if isinstance(g, TwinGpu)])
    return FreeRunningNode(free_running_profile(campaign, gpus[0].identity.name), clock, len(gpus))


def free_running_profile(campaign: Campaign, gpu_name: str) -> GpuProfile:
    """The twin profile whose load the twin engine puts on real GPUs (NVML) of model
    `gpu_name`: the campaign's `gpu.profile`, else the GPUs' own. A GPU the twin has no
    profile of is refused (`CampaignError`), not given the H100's load and times in silence
    (the cube recorded no profile): `gpu.profile` names the one to use, recorded then."""
    from dvfs.twin.profiles import gpu_profile, gpu_profiles, matching_gpu_profile

    if campaign.gpu.profile:
        return gpu_profile(campaign.gpu.profile)
    found = matching_gpu_profile(gpu_name)
    if found is None:
        raise CampaignError(
            f"the twin engine on real GPUs puts a twin GPU profile's load on them, and the "
            f"twin has no profile of {gpu_name}: set gpu.profile to the one whose load to put "
            f"on it ({', '.join(sorted(gpu_profiles()))}; the cube records it), or measure a "
            'real server with engine.backend = "sglang"'
        )
    return found


def check_engine(campaign: Campaign) -> LaunchHelp | None:
    """Refuse now what opening the campaign's engine would refuse about the campaign alone,
    needing no GPU and starting no server (SGLang: drafters it would serve with other kernels or
    scheduling, `dvfs.engines.sglang.check_servable`), so a sweep refuses before it makes a
    journal and `dvfs doctor` fails as the sweep would. Returns SGLang's `launch_server --help`
    if it was probed, for `open_backends`; None for the twin or when nothing needed it."""
    if simulated_engine(campaign):
        return None
    from dvfs.engines.sglang import check_servable
    from dvfs.engines.sglang_args import LaunchHelp, cached_help, server_command, server_env

    probed: list[LaunchHelp] = []

    def launch_help() -> str | None:
        if not probed:
            env = server_env(campaign)
            probed.append(LaunchHelp(cached_help(server_command(campaign), env)))
        return probed[0].text

    check_servable(campaign, launch_help)
    return probed[0] if probed else None


@contextlib.contextmanager
def open_backends(
    campaign: Campaign,
    *,
    out_dir: Path,
    nvml: ModuleType | None = None,
    launch_help: LaunchHelp | None = None,
) -> Iterator[Backends]:
    """The GPUs, engine and clock a campaign names, opened and closed together; `launch_help`:
    what `check_engine` probed, so SGLang is not probed again."""
    from dvfs.clock import MonotonicClock, VirtualClock

    clock: Clock = VirtualClock() if virtual_time(campaign) else MonotonicClock()
    with contextlib.ExitStack() as stack:
        gpus = stack.enter_context(open_campaign_gpus(campaign, clock, nvml=nvml))
        engine: Engine
        if simulated_engine(campaign):
            from dvfs.engines.twin import TwinEngine
            from dvfs.twin.profiles import model_profile

            model = model_profile(campaign.engine.simulated_model)
            engine = stack.enter_context(
                TwinEngine(
                    _twin_node(campaign, gpus, clock),
                    model,
                    texts=corpus_texts(campaign),
                    decode_graph_max_bs=max(campaign.workload.batch_sizes),
                    server_args=campaign.engine.sglang.extra_args,
                    server_env=campaign.engine.sglang.env,
                )
            )
        else:
            from dvfs.engines.sglang import SglangEngine
            from dvfs.gpu.nvml import processes_probe

            # Real GPUs pin the server to their UUIDs; twins have none a server could see.
            uuids = [g.identity.uuid for g in gpus] if real_gpus(campaign) else []
            engine = stack.enter_context(
                SglangEngine(
                    campaign,
                    clock=clock,
                    log_dir=out_dir / "logs",
                    gpu_uuids=uuids,
                    gpu_processes=processes_probe(gpus) if uuids else None,
                    launch_help=launch_help,
                )
            )
        yield Backends(clock, gpus, engine)


def tokenizer_model(campaign: Campaign) -> str | None:
    """The Hugging Face name whose tokenizer counts prompt tokens for this campaign: the twin's
    model profile names one; a real engine's model is its own name."""
    if simulated_engine(campaign):
        from dvfs.twin.profiles import find_model_profile

        profile = find_model_profile(campaign.engine.simulated_model)
        return profile.hf_name if profile is not None and profile.hf_name else None
    return campaign.engine.model


def _twin_gpu_profile(campaign: Campaign) -> GpuProfile | None:
    """The GPU profile whose memory the twin engine's server has: the campaign's twin GPUs',
    or the profile named for real ones; None where only the GPUs' name would tell."""
    from dvfs.twin.profiles import gpu_profile

    return gpu_profile(campaign.gpu.profile) if campaign.gpu.profile else None


def twin_start_refusal(campaign: Campaign) -> str | None:
    """Why the twin engine would not start the campaign's servers, as SGLang would not: a
    `--context-length` above the model's (`dvfs.twin.limits.context_length_refusal`), or the
    weights per GPU (the target's, with each drafter's draft model) leave nothing of its
    static memory for the KV cache (`dvfs.twin.limits.weights_refusal`; the fraction the
    campaign's SGLang args set, else SGLang's default). None: every server starts, or the
    engine is no twin."""
    if not simulated_engine(campaign):
        return None
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.limits import context_length_refusal, mem_fraction_static, weights_refusal
    from dvfs.twin.profiles import model_profile

    model = model_profile(campaign.engine.simulated_model)
    engine_args, env = campaign.engine.sglang.extra_args, campaign.engine.sglang.env
    context = context_length_refusal(model, engine_args, env)
    if context is not None:  # every server: one line says it
        return context
    context_refused = [
        f"drafter {d.name!r}: {why}"
        for d in campaign.drafters
        if (why := context_length_refusal(model, [*engine_args, *d.extra_args], env))
    ]
    if context_refused:
        return "; ".join(context_refused)
    gpu = _twin_gpu_profile(campaign)
    if gpu is None:
        return None
    tp, graph = campaign.engine.tp_size, max(campaign.workload.batch_sizes)
    alone = weights_refusal(model, None, gpu, tp, graph, mem_fraction_static(engine_args))
    if alone is not None:  # every server: one line says it
        return alone
    refused = []
    for drafter in campaign.drafters:
        plan = plan_drafter(drafter, model)
        fraction = mem_fraction_static([*engine_args, *drafter.extra_args])
        draft = plan.draft_model if plan is not None else None
        why = weights_refusal(model, draft, gpu, tp, graph, fraction)
        if why is not None:
            refused.append(f"drafter {drafter.name!r}: {why}")
    return "; ".join(refused) or None


#: The fewest new tokens the thermal stabilisation's load asks of each request (the first
#: round's prompts, for measurement.warmup_tokens if more: `Runner._stabilise`).
STABILISE_TOKENS = 64


def twin_context_overruns(campaign: Campaign, corpora: Mapping[str, Corpus]) -> str | None:
    """The corpora whose longest prompt the sweep may draw (`eligible_prompts`), with the
    output asked and the draft slots an EAGLE drafter reserves, exceeds the twin model's
    context length, which SGLang refuses (`dvfs.twin.limits.context_refusal`): one line naming
    each corpus, its prompt length and the context length, and the input bound that fits. The
    context length is each drafter's server's: its SGLang args' `--context-length`, else the
    model's (`dvfs.twin.limits.served_context_length`). None: every prompt fits, the context
    length is unknown, or the engine is no twin."""
    if not simulated_engine(campaign):
        return None
    from dvfs.corpora.sampling import eligible_prompts
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.limits import context_refusal, reserved_tokens, served_context_length
    from dvfs.twin.profiles import model_profile

    model = model_profile(campaign.engine.simulated_model)
    engine_args, env = campaign.engine.sglang.extra_args, campaign.engine.sglang.env
    # Each drafter's server serves its own context (its args' --context-length, else the
    # model's) less the draft slots it reserves: the tightest is the one every prompt must fit.
    budgets = []
    for drafter in campaign.drafters:
        served = served_context_length(model, [*engine_args, *drafter.extra_args], env)
        held = reserved_tokens(plan_drafter(drafter, model))
        if served:
            budgets.append((served - held, served, held))
    if not budgets:
        return None
    _, limit, reserved = min(budgets)
    w = campaign.workload
    m = campaign.measurement
    # What each request asks for new tokens, which SGLang refuses alike past the context: a
    # round (output_tokens), the warm-up (the first round's prompts for warmup_tokens) and,
    # after each server start where thermal_max_s is not 0, the thermal stabilisation (those
    # prompts for at least STABILISE_TOKENS, `Runner._stabilise`). Each unchecked ended the
    # sweep in "the server reported an error", the doctor and the dry run having said nothing.
    asks = [(w.output_tokens, "output_tokens", f"output_tokens = {w.output_tokens}")]
    if m.warmup_tokens:
        asks.append(
            (
                m.warmup_tokens,
                "measurement.warmup_tokens",
                f"measurement.warmup_tokens = {m.warmup_tokens}",
            )
        )
    if m.thermal_max_s > 0 and m.warmup_tokens < STABILISE_TOKENS:
        asks.append(
            (
                STABILISE_TOKENS,
                "measurement.thermal_max_s",
                f"the thermal stabilisation's {STABILISE_TOKENS} new tokens "
                f"(measurement.thermal_max_s = {m.thermal_max_s:g})",
            )
        )
    asked, key, said = max(asks, key=lambda a: a[0])
    longest_all = max(
        (p.input_tokens for c in corpora.values() for p in eligible_prompts(c, w.input_tokens)),
        default=0,
    )
    wide = _window_overrun(campaign, model, asked, said, longest_all)
    if wide is None:
        wide = _window_pool_overrun(campaign, model, asked, said, corpora)
    if wide is not None:
        return wide
    over, longest_over = [], 0
    for name, corpus in corpora.items():
        lengths = [p.input_tokens for p in eligible_prompts(corpus, w.input_tokens)]
        longest = max(lengths, default=0)
        if lengths and context_refusal(longest + reserved, asked, limit) is not None:
            over.append(f"corpus {name!r} has prompts of {longest} tokens")
            longest_over = max(longest_over, longest)
    if not over:
        return None
    slots = f" and {reserved} draft slots an EAGLE drafter reserves" if reserved else ""
    fits = limit - reserved - asked
    # (at most what the longest prompt leaves: the shortest bound's left the longer prompts over)
    room = limit - reserved - longest_over
    lower = [
        "set measurement.thermal_max_s = 0 (no thermal stabilisation)"
        if what == "measurement.thermal_max_s"
        else f"lower {what} (to at most {room})"
        for tokens, what, _ in asks
        if tokens > room
    ]
    if fits >= w.input_tokens[0]:
        stabilising = key == "measurement.thermal_max_s"
        instead = f"set {key} = 0" if stabilising else f"lower {key}"
        todo = f"set workload.input_tokens' upper bound to at most {fits} (or {instead})"
    else:
        todo = ", and ".join(lower)
    whose = f"context length of {model.hf_name or model.key} ({limit} tokens)"
    if limit != model.context_length:  # the campaign's --context-length, not the model's
        whose = f"context length its servers are started with (--context-length {limit})"
        if limit < model.context_length:
            todo += f", or raise --context-length (the model's is {model.context_length})"
    return (
        f"{'; '.join(over)}: with {said}{slots} that exceeds the "
        f"{whose}, and SGLang refuses such requests; {todo}"
    )


def _window_overrun(
    campaign: Campaign, model: ModelProfile, asked: int, said: str, longest: int
) -> str | None:
    """A drafter whose verify window (`dvfs.twin.limits.draft_window`: a DFLASH block, the
    tokens an n-gram, standalone or EAGLE tree verifies, an EAGLE tree's drafts) leaves the
    longest prompt (`longest` tokens) no room in its server's context with the `asked` new
    tokens: one line naming the drafter's key, its value and the most that fits. The window's
    tokens sit past the request's own in its context-length-wide row of SGLang's token-to-KV
    map (for the EAGLE family SGLang refuses the request ahead); a number past it ended the
    twin's sweep in an internal error (a block of 2**63 - 1 tokens overflowed its pass
    arithmetic). None: every drafter's fits; or the prompts themselves leave no room, or an
    EAGLE-family window leaves the shorter prompts room (SGLang refuses the longer ones): the
    corpus line says so, and offers an input bound."""
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.limits import EAGLE_ALGORITHMS, draft_window, served_context_length

    engine_args, env = campaign.engine.sglang.extra_args, campaign.engine.sglang.env
    shortest = campaign.workload.input_tokens[0]
    for drafter in campaign.drafters:
        plan = plan_drafter(drafter, model)
        window = draft_window(plan)
        served = served_context_length(model, [*engine_args, *drafter.extra_args], env)
        most = served - max(longest, shortest) - asked
        if plan is None or not served or window <= most or most < 2:
            continue  # (most < 2: no verify fits past the prompts, which are the problem)
        if plan.algorithm in EAGLE_ALGORITHMS and shortest + window + asked <= served:
            continue  # SGLang refuses the longer prompts: the corpus line offers an input bound
        key, value, bound = _window_key(plan, most)
        whose = f"context length of {model.hf_name or model.key} ({served} tokens)"
        if served != model.context_length:
            whose = f"context length its server is started with (--context-length {served})"
        return (
            f"drafters.{drafter.name}.{key} = {value} is above {bound}: each verify pass "
            f"places {window} tokens past a request's own, which with the longest prompt "
            f"({max(longest, shortest)} tokens) and {said} must fit in the {whose}; give "
            f"{key} at most {bound}"
        )
    return None


def _window_key(plan: DraftPlan, most: int) -> tuple[str, int, int]:
    """The key of a drafter (`plan`) that sets its verify window, its value, and its bound
    for a window of at most `most` tokens."""
    from dvfs.twin.limits import draft_window

    window = draft_window(plan)
    if plan.algorithm == "DFLASH":
        return "block_size", window, most
    if plan.algorithm == "NGRAM":
        return "num_draft_tokens", window, most
    if plan.topk == 1:  # SGLang forces num_draft_tokens = num_steps + 1
        return "num_steps", plan.num_steps, most - 1
    if plan.topk * plan.num_steps >= plan.verify_tokens:
        return "eagle_topk x num_steps", window, most
    return "num_draft_tokens", window, most


def _window_pool_overrun(
    campaign: Campaign,
    model: ModelProfile,
    asked: int,
    said: str,
    corpora: Mapping[str, Corpus],
) -> str | None:
    """A drafter whose verify windows, at the campaign's largest batch, take the requests
    past what the KV pool holds (`dvfs.twin.limits.kv_pool_tokens`, at most what SGLang's
    holds) where without them they fit: each of the batch's requests holds its prompt, the
    `asked` new tokens and a verify window of KV cache at once, and SGLang retracts requests
    the pool cannot hold, so the cell would not run at its batch. The prompts counted are the
    fewest a batch can draw (`dvfs.corpora.sampling.sample_prompts` draws distinct ones): the
    batch's shortest of a corpus, so this says only where every draw of that corpus overflows;
    counting the longest prompt for each request refused a batch whose prompts are mostly far
    shorter, which SGLang serves. One line naming the drafter's key, its value and the most
    that fits; a DFLASH block of 100000 tokens at batch 64 (6.4 million tokens of KV against
    Llama-3.1-8B's ~390000 on an H100) ran the dry run's estimate for minutes. None: every
    drafter's fits, the GPU is unknown, or the batch overflows the pool without them (no
    drafter's number is the fix)."""
    from dvfs.corpora.sampling import eligible_prompts
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.limits import (
        draft_window,
        given_max_total_tokens,
        kv_pool_tokens,
        mem_fraction_static,
    )

    gpu = _twin_gpu_profile(campaign)
    if gpu is None:
        return None
    engine_args = campaign.engine.sglang.extra_args
    batch = max(campaign.workload.batch_sizes)
    # The tokens of the fewest-token draw of `batch` distinct prompts of each corpus that has
    # that many (one with fewer is the corpus line's).
    least = {
        name: sum(sorted(lengths)[:batch])
        for name, corpus in corpora.items()
        if len(
            lengths := [
                p.input_tokens for p in eligible_prompts(corpus, campaign.workload.input_tokens)
            ]
        )
        >= batch
    }
    for drafter in campaign.drafters:
        plan = plan_drafter(drafter, model)
        if plan is None:
            continue
        args = [*engine_args, *drafter.extra_args]
        pool = kv_pool_tokens(
            model,
            plan.draft_model,
            gpu,
            campaign.engine.tp_size,
            batch,
            mem_fraction_static(args),
            given_max_total_tokens(args),
        )
        window = draft_window(plan)
        # The most each request's window may take with each corpus's fewest prompt tokens;
        # below 2, the batch overflows the pool without it (no drafter's number is the fix).
        fits = {name: (pool - prompts) // batch - asked for name, prompts in least.items()}
        fits = {name: most for name, most in fits.items() if most >= 2}
        if not fits:
            continue
        corpus = min(fits, key=lambda name: fits[name])
        most = fits[corpus]
        if window <= most:
            continue
        key, value, bound = _window_key(plan, most)
        need = least[corpus] + batch * (asked + window)
        return (
            f"drafters.{drafter.name}.{key} = {value} is above {bound}: at batch {batch} "
            f"each request holds a verify pass's {window} tokens of KV cache past its own, and "
            f"the {batch} requests, with {said} and the fewest prompt tokens corpus "
            f"{corpus!r} can give them ({least[corpus]}, its {batch} shortest prompts), then "
            f"need at least {need} tokens of it, more than the ~{pool} that "
            f"{model.hf_name or model.key} leaves on {gpu.nvml_name} (tp "
            f"{campaign.engine.tp_size}): SGLang would retract requests, and the cell would "
            f"not run at batch {batch}; give {key} at most {bound}"
        )
    return None


def twin_inflight_overruns(campaign: Campaign, corpora: Mapping[str, Corpus]) -> str | None:
    """An in-flight twin campaign (`measurement.mode = "in-flight"`) whose decodes cannot
    hold one segment at each knob level within the context its servers serve: one line naming
    the first group (drafter, batch, corpus) that cannot, and what to change. A decode asks
    at most what the context leaves past its batch's longest prompt (`new_tokens_room`), and
    a level no decode reaches before it ends is never measured (abba visits the levels in one
    order in every decode; a serpentine's decodes in two, ending before the middle). The
    tokens are the twin's physics (`dvfs.twin.physics`): each level's segment (its settle a
    number given, else the twin clock's settling time, which a measured settle is at least)
    at its own clock and power limit, at the drafter's expected acceptance on the corpus's
    text, every pass at the middle of the context the longest prompt leaves (a pass's time
    grows linearly with it). None: it fits, the context length or the GPU is unknown, or it
    is no in-flight twin campaign."""
    m = campaign.measurement
    if m.mode != "in-flight" or not simulated_engine(campaign):
        return None
    gpu = _twin_gpu_profile(campaign)
    if gpu is None:
        return None
    import numpy as np

    from dvfs.corpora.sampling import eligible_prompts
    from dvfs.measure.inflight import measured_seconds
    from dvfs.twin import physics
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.limits import reserved_tokens, served_context_length
    from dvfs.twin.passes import PassBuilder, decode_passes
    from dvfs.twin.profiles import model_profile

    model = model_profile(campaign.engine.simulated_model)
    engine_args, env = campaign.engine.sglang.extra_args, campaign.engine.sglang.env
    w, knobs = campaign.workload, campaign.knobs
    levels = len(knobs.settings)
    # a settle measured at session start is at least the time the twin's clock takes
    settle = float(m.settle) if isinstance(m.settle, int | float) else gpu.settle_time_s
    segment_s = settle + measured_seconds(
        levels, m.inflight_order, m.min_window_s, m.sample_period_s
    )
    settings = [
        (clock or gpu.max_sm_clock_mhz, limit or gpu.power_limit_default_w)
        for clock, limit in knobs.settings
    ]
    texts = corpus_texts(campaign, corpora)
    for drafter in campaign.drafters:
        served = served_context_length(model, [*engine_args, *drafter.extra_args], env)
        if not served:
            continue
        plan = plan_drafter(drafter, model)
        context = served - reserved_tokens(plan)
        #: tokens per request decoded over one segment at every level, by (batch, tokens per
        #: verify, context): corpora alike share them
        known: dict[tuple[int, float, float], float] = {}
        for name, corpus in corpora.items():
            longest = max(
                (p.input_tokens for p in eligible_prompts(corpus, w.input_tokens)), default=0
            )
            room = context - longest
            if room <= 0 or name not in texts:  # no room at all: `twin_context_overruns` says
                continue
            per_pass = plan.expected_accept_length(texts[name], w.temperature) if plan else 1.0
            # a pass's time grows linearly with the context: a decode to the context's end
            # takes as long as its passes at its middle
            middle = longest + room / 2
            for batch in w.batch_sizes:
                key = (batch, per_pass, middle)
                if key not in known:
                    # one decode iteration, every request at that context, as the twin
                    # engine builds a full batch's (`dvfs.twin.predict.window_passes`)
                    at = np.full((batch, 1), middle)
                    builder = PassBuilder(campaign.engine.tp_size)
                    decode_passes(
                        builder,
                        model,
                        plan,
                        np.full(1, float(batch)),
                        at.sum(axis=0),
                        np.asarray(model.kv_bytes_read(at), dtype=float).sum(axis=0),
                        np.full(1, middle),
                        np.full(1, batch * per_pass),
                    )
                    passes = builder.parts[-1]
                    known[key] = math.fsum(
                        segment_s
                        * per_pass
                        / float(
                            physics.operating_point(
                                gpu, passes, clock, limit
                            ).timing.duration_s.sum()
                        )
                        for clock, limit in settings
                    )
                needed = math.floor(known[key])
                if needed > room:
                    return (
                        f"in-flight stepping cannot fit one segment at each of the {levels} "
                        f"knob levels in a decode: drafter {drafter.name!r} at batch {batch} on "
                        f"corpus {name!r} decodes about {needed} tokens per request over "
                        f"them ({segment_s:.2f} s each), where the context ({served} tokens) "
                        f"leaves {room} past its longest prompt of {longest} tokens; step "
                        "fewer levels (sm_clock, power_limit), lower min_window_s, shorten the "
                        "prompts (workload.input_tokens) or raise --context-length, or measure "
                        'per level (measurement.mode = "per-level")'
                    )
    return None


def check_twin_context(campaign: Campaign, corpora: Mapping[str, Corpus]) -> None:
    """Refuse (`PromptTooLongError`, exit 2) a twin campaign whose prompts would not fit its
    model's context (`twin_context_overruns`), and (`CampaignError`, exit 2) an in-flight one
    whose decodes cannot hold one segment per knob level there (`twin_inflight_overruns`):
    before a journal is made or a GPU touched."""
    from dvfs.errors import PromptTooLongError

    line = twin_context_overruns(campaign, corpora)
    if line is not None:
        raise PromptTooLongError(line)
    line = twin_inflight_overruns(campaign, corpora)
    if line is not None:
        raise CampaignError(line)


@dataclass(frozen=True)
class ServerPlan:
    """What one drafter's server would be: SGLang's launch argv, the running server it attaches
    to (engine.sglang.url, without its credentials), or the twin's drafting plan."""

    drafter: str
    argv: tuple[str, ...] | None = None
    attached_to: str | None = None
    flags_from: str | None = None
    algorithm: str | None = None
    num_steps: int | None = None
    topk: int | None = None
    verify_tokens: int | None = None
    expected_accept_length: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape `dvfs sweep --dry-run --json` prints (only the fields that apply)."""
        if self.argv is not None:
            # Printed and shared as a preview: credentials hidden (`dvfs.redact`).
            argv = redact_argv(self.argv)
            return {"drafter": self.drafter, "argv": argv, "flags_from": self.flags_from}
        if self.attached_to is not None:
            return {"drafter": self.drafter, "attached_to": self.attached_to}
        entry: dict[str, Any] = {"drafter": self.drafter, "algorithm": self.algorithm}
        if self.verify_tokens is not None:
            entry.update(
                num_steps=self.num_steps,
                topk=self.topk,
                verify_tokens=self.verify_tokens,
                expected_accept_length=dict(self.expected_accept_length),
            )
        return entry


def server_plans(campaign: Campaign, *, here: bool = True) -> list[ServerPlan]:
    """Per drafter, what its server would be, without starting one. An attached server
    (engine.sglang.url) is no launch: as the sweep, this runs no `launch_server --help` and
    predicts nothing of it from this machine's SGLang (the sweep checks the server once it
    answers, `dvfs.engines.sglang.check_attached`). `here` False: dvfs starts them on other
    machines (`--executor ray`), `planned_launches`'."""
    url = campaign.engine.sglang.url
    if not simulated_engine(campaign) and url:
        from dvfs.redact import redact_url

        return [ServerPlan(d.name, attached_to=redact_url(url)) for d in campaign.drafters]
    if not simulated_engine(campaign):
        from dvfs.engines.sglang_args import planned_launches

        return [
            ServerPlan(name, argv=tuple(argv), flags_from=source)
            for name, argv, source in planned_launches(campaign, here=here)
        ]
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.profiles import model_profile

    model = model_profile(campaign.engine.simulated_model)
    texts = corpus_texts(campaign)
    plans = []
    for drafter in campaign.drafters:
        plan = plan_drafter(drafter, model)
        if plan is None:
            plans.append(ServerPlan(drafter.name, algorithm=drafter.algorithm or "none"))
            continue
        plans.append(
            ServerPlan(
                drafter.name,
                algorithm=drafter.algorithm or "none",
                num_steps=plan.num_steps,
                topk=plan.topk,
                verify_tokens=plan.verify_tokens,
                expected_accept_length={
                    c: round(plan.expected_accept_length(text, campaign.workload.temperature), 2)
                    for c, text in texts.items()
                },
            )
        )
    return plans
