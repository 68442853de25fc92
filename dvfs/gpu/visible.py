"""Which NVML GPUs CUDA_VISIBLE_DEVICES gives this job, so dvfs never locks or meters another.

NVML ignores CUDA_VISIBLE_DEVICES: dvfs's GPU 0 is NVML's GPU 0 whatever a scheduler gave
the job (Slurm without device cgroups, a shared box where the user picks
`CUDA_VISIBLE_DEVICES=3`), and the server dvfs starts is pinned to that GPU by UUID. So a
command that changes or meters GPUs resolves the variable's entries to NVML GPUs the way CUDA
reads them, and refuses a GPU outside them (`check`). Entries, read in order as CUDA does:

- a UUID (`GPU-8932f937-...`), or a prefix of one that names a single GPU of this machine
  (CUDA accepts those too), found among NVML's UUIDs;
- an integer: an NVML index. CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER is
  `PCI_BUS_ID`, NVML by PCI bus; the two agree on a node of one GPU model (ties go by bus), so
  this assumes `CUDA_DEVICE_ORDER=PCI_BUS_ID` order;
- a MIG instance (`MIG-...`): refused, since dvfs meters and controls whole GPUs.

A GPU fallen off the bus (or needing a reset, or failing NVML otherwise, or hanging) has no
UUID NVML can read ("" among the machine's UUIDs): a UUID entry that names no other GPU is
taken for it where it is the one such GPU (opening it then names its error, rather than the
variable being blamed); with several, none is.

CUDA stops at the first entry it cannot read (`-1`, an index past the last GPU, a UUID not
here), seeing only the GPUs before it; so does this. Pure functions over the machine's UUIDs
(in NVML index order), so they are tested without NVML; `dvfs.gpu.nvml` reads those UUIDs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dvfs.errors import CampaignError

VARIABLE = "CUDA_VISIBLE_DEVICES"

#: How a sweep names GPUs, for the hint of a refusal ({indices}: `3,5`; {listed}: `3, 5`;
#: {spaced}: `3 5`).
SWEEP_NAMING = "--gpus {indices} (or gpu.devices = [{listed}], or their UUIDs)"


@dataclass(frozen=True)
class Visible:
    """CUDA_VISIBLE_DEVICES as this process found it, and how the command at hand names GPUs
    (a template as `SWEEP_NAMING`), for the line that refuses a GPU outside it."""

    value: str
    naming: str = SWEEP_NAMING

    @classmethod
    def from_env(cls, environ: Mapping[str, str], naming: str = SWEEP_NAMING) -> Visible | None:
        """The variable from `environ`; None when it is unset or empty (nothing to hold to)."""
        value = environ.get(VARIABLE, "")
        return cls(value, naming) if value.strip() else None


@dataclass(frozen=True)
class Resolved:
    """The NVML indices CUDA would see, in CUDA's order, and the entry where CUDA would stop
    reading (None when it read them all)."""

    indices: tuple[int, ...]
    stopped_at: str | None = None


def resolve(value: str, uuids: Sequence[str]) -> Resolved:
    """The NVML GPUs `value` (CUDA_VISIBLE_DEVICES) names on a machine whose GPUs have `uuids`
    by NVML index; a MIG entry is a `CampaignError`."""
    found: list[int] = []
    lowered = [u.lower() for u in uuids]
    for raw in value.split(","):
        entry = raw.strip()
        if entry.upper().startswith("MIG-"):
            raise CampaignError(
                f"{VARIABLE}={value!r} names a MIG instance ({entry}): dvfs meters and controls "
                f"whole GPUs (NVML's energy counter is per GPU), not MIG slices; give the job "
                f"whole GPUs, or unset {VARIABLE}"
            )
        index: int | None = None
        if entry.isdigit():
            index = int(entry) if int(entry) < len(uuids) else None
        elif entry.upper().startswith("GPU-") and len(entry) > len("GPU-"):
            matches = [i for i, u in enumerate(lowered) if u and u.startswith(entry.lower())]
            if not matches and lowered.count("") == 1:
                # No readable UUID is it, and one GPU's UUID cannot be read (fallen off the
                # bus, failing): the job's GPU is that one, which opening it then names.
                matches = [lowered.index("")]
            index = matches[0] if len(matches) == 1 else None
        if index is None:
            return Resolved(tuple(found), entry)
        if index not in found:
            found.append(index)
    return Resolved(tuple(found))


def check(gpus: Sequence[tuple[int, str]], visible: Visible, uuids: Sequence[str]) -> None:
    """Refuse (`CampaignError`, exit 2, one line) the first of `gpus` ((NVML index, UUID)
    pairs) that `visible` does not give this job, on a machine whose GPUs have `uuids`."""
    resolved = resolve(visible.value, uuids)
    allowed = set(resolved.indices)
    for index, uuid in gpus:
        if index in allowed:
            continue
        if resolved.indices:
            names = ", ".join(str(i) for i in resolved.indices)
            gives = f"NVML GPU{'s' if len(resolved.indices) > 1 else ''} {names}"
            use = visible.naming.format(
                indices=",".join(str(i) for i in resolved.indices),
                listed=names,
                spaced=" ".join(str(i) for i in resolved.indices),
            )
            what = f"use {use}, or unset {VARIABLE}"
        else:
            gives = "none of this machine's GPUs"
            what = f"name the job's GPUs in {VARIABLE}, or unset it"
        cut = (
            f"; CUDA reads no further than {resolved.stopped_at!r}"
            if resolved.stopped_at is not None
            else ""
        )
        unread = [str(i) for i, u in enumerate(uuids) if not u]
        if cut and unread:  # the entry may name one of them
            cut += (
                f", perhaps one of GPUs {', '.join(unread)}, fallen off the bus or failing (NVML "
                "cannot read their UUIDs)"
            )
        raise CampaignError(
            f"GPU {index} ({uuid}) is not among the GPUs {VARIABLE}={visible.value!r} gives "
            f"this job ({gives}{cut}): dvfs names GPUs as NVML does, which ignores that "
            f"variable, and would lock and meter a GPU the job was not given; {what}"
        )
