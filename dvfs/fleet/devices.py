"""Which GPUs each worker owns: `--gpus 0-7` (indices, ranges, UUIDs) or the campaign's
`gpu.devices` groups, cut into groups of `engine.tp_size` (one server each).

On the twin, `--gpus h200-sxm:0-3` names twin GPUs of another profile than the campaign's
(`PROFILE:INDEX`), so a fleet mixing GPU models can be tried without hardware. They simulate
the campaign's NVML traps (`gpu.profile = "h100-sxm:none"` makes `h200-sxm:0` trap-free too):
a fleet measures what one GPU would."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dvfs.campaign import Campaign
from dvfs.errors import CampaignError
from dvfs.gpu.base import canonical_uuid
from dvfs.redact import redact_url

Group = tuple[int | str, ...]


def parse_gpus(spec: str) -> list[int | str]:
    """`0-7`, `0,2,5`, `0-3,6` or `GPU-...,GPU-...` as a list of indices and UUIDs, in order;
    a `CampaignError` (one line) for anything else."""
    devices: list[int | str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise CampaignError(f"--gpus {spec!r}: an empty entry; write e.g. 0-7 or 0,2,5")
        profile = ""
        if ":" in part and not part.upper().startswith(("GPU-", "MIG-")):
            profile, part = (x.strip() for x in part.rsplit(":", 1))
        indices: list[int] = []
        if part.upper().startswith(("GPU-", "MIG-")):
            devices.append(canonical_uuid(part))
        elif part.isdigit():
            indices.append(int(part))
        elif part.count("-") == 1 and all(x.strip().isdigit() for x in part.split("-")):
            lo, hi = (int(x) for x in part.split("-"))
            if hi < lo:
                raise CampaignError(f"--gpus {spec!r}: the range {part} runs backwards")
            indices.extend(range(lo, hi + 1))
        else:
            raise CampaignError(
                f"--gpus {spec!r}: {part!r} is neither a GPU index, a range (0-7) nor a UUID "
                "(GPU-...)"
            )
        devices.extend(f"{profile}:{i}" if profile else i for i in indices)
    if len(set(devices)) != len(devices):
        raise CampaignError(f"--gpus {spec!r} names a GPU twice")
    return devices


def worker_groups(campaign: Campaign, gpus: Sequence[int | str] | None = None) -> list[Group]:
    """One group per worker: `gpus` cut into runs of `engine.tp_size`, else the campaign's
    `gpu.devices` groups, else its devices as one group. A server attached at
    engine.sglang.url serves one worker only (`_one_attached_worker`)."""
    groups = _worker_groups(campaign, gpus)
    _one_attached_worker(campaign, groups, from_gpus=gpus is not None)
    return groups


def _one_attached_worker(campaign: Campaign, groups: Sequence[Group], *, from_gpus: bool) -> None:
    """Refuse more than one worker on a server attached at engine.sglang.url: each worker
    would meter its own GPUs while every worker's requests ran on that one server (on other
    GPUs than most of them meter, batched with the other workers' requests)."""
    url = campaign.engine.sglang.url
    if campaign.engine.backend != "sglang" or not url or len(groups) < 2:
        return
    where = "--gpus" if from_gpus else "gpu.devices"
    raise CampaignError(
        f"{where} makes {len(groups)} workers, but engine.sglang.url attaches every one to "
        f"the one server at {redact_url(url)}: each would meter its own GPUs while all their "
        "requests ran on that server; give one GPU group (the one the server runs on), or "
        "drop engine.sglang.url so that dvfs starts a server per worker"
    )


def _worker_groups(campaign: Campaign, gpus: Sequence[int | str] | None) -> list[Group]:
    if gpus is None:
        if campaign.gpu.groups:
            return [tuple(g) for g in campaign.gpu.groups]
        return [tuple(campaign.gpu.devices)]
    size = campaign.engine.tp_size
    if not gpus or len(gpus) % size:
        raise CampaignError(
            f"--gpus names {len(gpus)} GPU(s), which do not split into servers of "
            f"engine.tp_size = {size}"
        )
    if campaign.gpu.backend == "twin":
        from dvfs.twin.profiles import gpu_profile, gpu_profiles

        for device in gpus:
            if isinstance(device, int):
                continue
            profile = device.rsplit(":", 1)[0] if ":" in device else None
            if profile is None:
                raise CampaignError(
                    f"the twin's GPUs are named by index (0, 1, ...) or PROFILE:INDEX, not {device}"
                )
            if profile.partition(":")[0] not in gpu_profiles():
                raise CampaignError(
                    f"--gpus: unknown twin profile {profile!r}; choose one of "
                    f"{', '.join(sorted(gpu_profiles()))}"
                )
            try:
                gpu_profile(profile)
            except ValueError as exc:
                raise CampaignError(f"--gpus: twin profile {profile!r}: {exc}") from None
        named = list(gpus)
        gpus = [d if isinstance(d, int) else _own_index(campaign, d) for d in named]
        for i, device in enumerate(gpus):
            if device in gpus[:i]:
                first = named[gpus.index(device)]
                which = (  # another profile's stays PROFILE:INDEX, with the campaign's traps
                    f"the campaign's {campaign.gpu.profile} GPU {device}"
                    if isinstance(device, int)
                    else f"twin GPU {device}"
                )
                raise CampaignError(
                    f"--gpus names a GPU twice: {first} and {named[i]} are both {which}"
                )
    elif any(isinstance(d, str) and ":" in d for d in gpus):
        raise CampaignError(
            "--gpus PROFILE:INDEX names twin GPUs; real GPUs are named by index or UUID"
        )
    groups = [tuple(gpus[i : i + size]) for i in range(0, len(gpus), size)]
    for group in groups:
        _profile_of(group)
    return groups


def _with_campaign_traps(campaign: Campaign, device: str) -> str:
    """`PROFILE:INDEX` spelled with the campaign's trap list, so the fleet's twins simulate the
    traps the campaign asked for rather than all of them; a trap list naming another set is a
    `CampaignError` (the cube would mix two measurement methods under one campaign)."""
    from dvfs.twin.profiles import active, gpu_profile

    profile, index = device.rsplit(":", 1)
    base, _, spec = profile.partition(":")
    ours = campaign.gpu.profile or ""
    ours_base, _, ours_spec = ours.partition(":")
    if spec and active(gpu_profile(f"{ours_base}:{spec}")) != active(gpu_profile(ours)):
        raise CampaignError(
            f"--gpus {device}: other NVML traps than the campaign's gpu.profile = {ours!r}; "
            f"write {base}:{index} to keep the campaign's traps, or change gpu.profile"
        )
    return f"{base}:{ours_spec}:{index}" if ours_spec else f"{base}:{index}"


def _own_index(campaign: Campaign, device: str) -> int | str:
    """A twin `PROFILE:INDEX` with the campaign's traps (`_with_campaign_traps`); its plain
    index where that is the campaign's own gpu.profile (`h100-sxm:1` on an h100-sxm campaign
    is its GPU 1, of the same model as a plain `0`)."""
    device = _with_campaign_traps(campaign, device)
    profile, index = device.rsplit(":", 1)
    return int(index) if profile == campaign.gpu.profile else device


def _profile_of(group: Group) -> str | None:
    """The twin profile a group names (`PROFILE:INDEX`), None for plain indices."""
    profiles = {d.rsplit(":", 1)[0] if isinstance(d, str) and ":" in d else None for d in group}
    if len(profiles) > 1:
        raise CampaignError(
            f"--gpus groups {', '.join(map(str, group))} into one server: one GPU model per group"
        )
    return profiles.pop()


def workers_per_model(
    campaign: Campaign, groups: Sequence[Group], models: Sequence[str] | None = None
) -> dict[str | None, int]:
    """How many workers each GPU model gets, as far as the names tell (twin GPUs: their
    profile's model, `PROFILE:INDEX` or the campaign's; real GPUs: `models`, each group's as
    NVML names it, else one model, None; a real GPU's `gpu.profile` only names the twin that
    estimates it): a fleet mixing models runs the whole campaign once per model, on that
    model's workers only."""
    counts: dict[str | None, int] = {}
    twin = campaign.gpu.profile if campaign.gpu.backend == "twin" else None
    for index, group in enumerate(groups):
        profile = _profile_of(group) or twin
        model = profile.split(":", 1)[0] if profile else None
        if model is None and models is not None:
            model = models[index]
        counts[model] = counts.get(model, 0) + 1
    return counts


def for_group(campaign: Campaign, group: Group) -> Campaign:
    """The campaign as one worker runs it: its own group's GPUs, one server on them."""
    profile = _profile_of(group)
    if profile is None:
        gpu = dataclasses.replace(campaign.gpu, devices=tuple(group), groups=())
    else:
        indices = tuple(int(str(d).rsplit(":", 1)[1]) for d in group)
        gpu = dataclasses.replace(campaign.gpu, devices=indices, groups=(), profile=profile)
    return dataclasses.replace(campaign, gpu=gpu)


def one_model(worker: str, gpus: Sequence[tuple[int, str]]) -> str:
    """The GPU model of one server's GPUs (`worker`, as `group_label` names it; each GPU's
    NVML index and model, in order): a tensor-parallel server runs on one model, so GPUs of
    two are a `CampaignError` (exit 2) naming each GPU's, in the words the sweep (one server,
    `dvfs.preflight.check_server_gpus`), a fleet and `dvfs doctor` refuse it with, before anything
    is measured (their cells would not compare, and the cube would be refused)."""
    names = {name for _, name in gpus}
    if len(names) > 1:
        shown = ", ".join(f"GPU {index}: {name}" for index, name in gpus)
        raise CampaignError(
            f"worker {worker} spans GPUs of different models ({shown}); a tensor-parallel "
            "group is one model: group GPUs of one model (--gpus, or gpu.devices)"
        )
    return names.pop()


def identity_difference(gpus: Sequence[Mapping[str, Any]]) -> str | None:
    """The first GPU invariant besides the model (`dvfs.records.GPU_INVARIANTS`, compared
    where known) in which `gpus` (each GPU's identity as a session records it) differ, with
    each GPU's value ("ECC mode (GPU 0: on, GPU 1: off)"); None where they do not."""
    from dvfs.records import GPU_INVARIANTS

    for key, label in GPU_INVARIANTS.items():
        said = [(g.get("index"), str(g[key])) for g in gpus if g.get(key) not in (None, "")]
        if len({value for _, value in said}) > 1:
            return f"{label} ({', '.join(f'GPU {index}: {value}' for index, value in said)})"
    return None


def one_identity(worker: str, gpus: Sequence[Mapping[str, Any]]) -> None:
    """Refuse one server's GPUs (`worker`; each GPU's identity as a session records it) that
    differ in a GPU invariant besides the model (`identity_difference`): GPUs of one model
    with other ECC modes, or VBIOS, on one node. A `CampaignError` (exit 2) naming each GPU's,
    before anything is measured: their session's cube is refused (`dvfs.records.mixed_within`),
    only once every cell was measured."""
    differ = identity_difference(gpus)
    if differ is not None:
        raise CampaignError(
            f"worker {worker} spans GPUs that differ in their {differ}: a journal's GPUs share "
            "it, and its cube would be refused once every cell was measured; group GPUs alike "
            "(--gpus, or gpu.devices)"
        )


def fleet_identity_refusal(gpus: Sequence[Mapping[str, Any]]) -> str | None:
    """Why a fleet refuses its workers of one GPU model (each GPU's identity, as a session
    records it) when they open their sessions (`dvfs.fleet.driver.combine_sessions`), for
    `dvfs doctor` and the dry run to say first: GPUs of one model that differ in a GPU
    invariant (`identity_difference`); None where none do."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for g in gpus:
        by_model.setdefault(str(g.get("name")), []).append(g)
    for model, theirs in by_model.items():
        differ = identity_difference(theirs)
        if differ is not None:
            return (
                f"the fleet's {model} GPUs differ in their {differ}: their workers' cells "
                "cannot share one journal; leave the odd ones out (--gpus), or run them into "
                "separate --out folders and `dvfs cube merge` the cubes"
            )
    return None


def group_label(group: Group) -> str:
    """How progress and the journal name a worker: `gpu0`, `gpu2+3`, or a short UUID."""
    profile = _profile_of(group)
    if profile is not None:
        name = re.sub(r"[^A-Za-z0-9_.+-]", "_", profile)
        return f"{name}-gpu" + "+".join(str(d).rsplit(":", 1)[1] for d in group)
    return "gpu" + "+".join(str(d) if isinstance(d, int) else d[4:12] for d in group)
