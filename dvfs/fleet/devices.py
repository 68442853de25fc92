"""Which GPUs each worker owns: `--gpus 0-7` (indices, ranges, UUIDs) or the campaign's
`gpu.devices` groups, cut into groups of `engine.tp_size` (one server each)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dvfs.campaign import Campaign
from dvfs.errors import CampaignError

Group = tuple[int | str, ...]


def parse_gpus(spec: str) -> list[int | str]:
    """`0-7`, `0,2,5`, `0-3,6` or `GPU-...,GPU-...` as a list of indices and UUIDs, in order;
    a `CampaignError` (one line) for anything else."""
    devices: list[int | str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise CampaignError(f"--gpus {spec!r}: an empty entry; write e.g. 0-7 or 0,2,5")
        if part.startswith(("GPU-", "MIG-")):
            devices.append(part)
        elif part.isdigit():
            devices.append(int(part))
        elif part.count("-") == 1 and all(x.strip().isdigit() for x in part.split("-")):
            lo, hi = (int(x) for x in part.split("-"))
            if hi < lo:
                raise CampaignError(f"--gpus {spec!r}: the range {part} runs backwards")
            devices.extend(range(lo, hi + 1))
        else:
            raise CampaignError(
                f"--gpus {spec!r}: {part!r} is neither a GPU index, a range (0-7) nor a UUID "
                "(GPU-...)"
            )
    if len(set(devices)) != len(devices):
        raise CampaignError(f"--gpus {spec!r} names a GPU twice")
    return devices


def worker_groups(campaign: Campaign, gpus: Sequence[int | str] | None = None) -> list[Group]:
    """One group per worker: `gpus` cut into runs of `engine.tp_size`, else the campaign's
    `gpu.devices` groups, else its devices as one group."""
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
        named = [d for d in gpus if not isinstance(d, int)]
        if named:
            raise CampaignError(f"the twin's GPUs are named by index (0, 1, ...), not {named[0]}")
    return [tuple(gpus[i : i + size]) for i in range(0, len(gpus), size)]


def for_group(campaign: Campaign, group: Group) -> Campaign:
    """The campaign as one worker runs it: its own group's GPUs, one server on them."""
    gpu = dataclasses.replace(campaign.gpu, devices=tuple(group), groups=())
    return dataclasses.replace(campaign, gpu=gpu)


def group_label(group: Group) -> str:
    """How progress and the journal name a worker: `gpu0`, `gpu2+3`, or a short UUID."""
    return "gpu" + "+".join(str(d) if isinstance(d, int) else d[4:12] for d in group)
