"""Where a started server took its memory: the fallback of "the server runs on the metered GPUs
only" where NVML lists none of its processes by a PID dvfs knows (a container's PID namespace:
NVML names them by the host's PIDs) or cannot list processes at all.

SGLang claims most of each of its GPUs' memory as it starts (--mem-fraction-static of the GPU's
total, by default 0.7-0.9 by the GPU's memory: weights and KV cache, before it answers), so
every GPU's used memory is read right before the server starts and again once it answers: the
metered GPUs' grew by about that claim and no other GPU's did ("verified by memory: ..."), or a
GPU dvfs does not meter grew by it while the metered ones took nothing (refused, as a stray PID
is), or memory cannot tell (another tenant's job starting meanwhile, a tenant's memory leaving
SGLang less, memory NVML cannot read): the pinning stays "unverified", saying why. Where
--max-total-tokens caps the server's KV pool, it takes only its weights and that pool, maybe
far less than its claim: a metered GPU grown short of it then says nothing of where the server
is, so nothing is refused by memory (another tenant's server starting elsewhere meanwhile would
be taken for this one). A GPU's growth is the most of what NVML says of it: its used memory's,
and where it lists processes with their own memory, the new processes' (not fooled by an
earlier server's memory still being freed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeGuard

from dvfs.errors import EngineError
from dvfs.gpu.base import UNREAD_UUID, GpuProcesses

#: The share of the server's claim (mem_fraction_static x the GPU's memory) a GPU's memory must
#: grow by to count as holding the server: SGLang fills its GPU up to the claim, less what
#: another tenant held there before, and a tenant's memory noise stays well under half of it.
CLAIM_SHARE = 0.5
#: The --mem-fraction-static taken where neither the server reports one nor dvfs passes one:
#: the least of SGLang's defaults on the GPUs dvfs meters (0.7-0.9, by the GPU's memory).
DEFAULT_FRACTION = 0.7
#: A claim below this tells the server's memory from tenants' noise no longer.
MIN_CLAIM_BYTES = 2 * 2**30
#: Said of the fix where the server's memory went to a GPU dvfs does not meter.
WRAPPER_FIX = (
    "check CUDA_VISIBLE_DEVICES and the engine.sglang.server_command wrapper (docker, srun, "
    "env), which must pass it on"
)


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def server_fraction(args: Mapping[str, object], given: float | None) -> tuple[float, str]:
    """The server's --mem-fraction-static and how it is known: as it reports it resolved
    (`args`, its /server_info), else as dvfs passed it (`given`), else `DEFAULT_FRACTION`."""
    reported = args.get("mem_fraction_static")
    if _fraction(reported):
        return float(reported), f"mem_fraction_static {float(reported):g}"
    if _fraction(given):
        return float(given), f"mem_fraction_static {given:g} as passed"
    return DEFAULT_FRACTION, f"mem_fraction_static unreported, {DEFAULT_FRACTION:g} taken"


def _fraction(value: object) -> TypeGuard[int | float]:
    """Whether `value` is a share of a GPU's memory (a number in (0, 1]): a server's /server_info
    (or a hand-written value) may say anything, and a claim above the GPU's memory, infinite or
    NaN would judge the memory by nonsense."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= 1
    )


def kv_cap(args: Mapping[str, object], given: int | None) -> int | None:
    """The server's --max-total-tokens (its KV pool's cap), as its /server_info reports it
    (0.5.9 and 0.5.23 alike: null unless given), else as dvfs passed it; None: uncapped."""
    reported = args.get("max_total_tokens")
    if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0:
        return reported
    return given if given is not None and given > 0 else None


def _key(gpu: GpuProcesses) -> str:
    """How a GPU read before the start is found again after it: by its UUID, or where NVML
    could not read that ("?"), by its index (several such GPUs would be taken for one)."""
    return gpu.uuid if gpu.uuid != UNREAD_UUID else f"{UNREAD_UUID}{gpu.index}"


def _took(before: GpuProcesses, after: GpuProcesses) -> tuple[int, str]:
    """How much memory `after`'s GPU took since `before` (bytes) and the evidence: its used
    memory's growth, and where NVML lists processes with their own memory, its new processes'
    (the more of the two: an earlier server's memory still being freed hides the growth)."""
    assert before.used_bytes is not None and after.used_bytes is not None
    grown = after.used_bytes - before.used_bytes
    used = f"used memory {'+' if grown >= 0 else '-'}{_gib(abs(grown))}"
    if after.pids is not None and before.pids is not None:
        fresh = after.pids - before.pids
        if fresh and all(_plausible(after.process_bytes.get(p), after) for p in fresh):
            new = sum(after.process_bytes[p] for p in fresh)
            return max(new, grown), f"{_gib(new)} in {len(fresh)} new compute process(es), {used}"
    return grown, used


def _plausible(held: object, gpu: GpuProcesses) -> bool:
    """Whether `held` (a process's or the GPU's used memory, bytes) is one NVML could mean: a
    whole number from nought to the GPU's total. NVML_VALUE_NOT_AVAILABLE (2**64 - 1, passed on
    as it is by a binding that does not turn it to None) or memory above the GPU's would read as
    a server's claim on a GPU that took nothing."""
    return (
        isinstance(held, int)
        and not isinstance(held, bool)
        and 0 <= held <= (gpu.total_bytes if gpu.total_bytes is not None else held)
    )


def _nonsense(gpu: GpuProcesses) -> str:
    """Why the used memory NVML read of `gpu` cannot be ("": it can)."""
    if gpu.used_bytes is None or _plausible(gpu.used_bytes, gpu):
        return ""
    return f"NVML says {gpu.used_bytes} bytes used of {gpu.total_bytes}"


def memory_outcome(
    drafter: str,
    before: Sequence[GpuProcesses],
    after: Sequence[GpuProcesses],
    metered: Sequence[str],
    fraction: tuple[float, str],
    by_pid: str,
    cap: int | None = None,
) -> str:
    """The pinning by memory ("verified by memory: ..." or "unverified: `by_pid`; memory
    cannot tell: why"), from every GPU read right before the server started (`before`) and
    once it answered (`after`); `fraction`: its --mem-fraction-static and how it is known
    (`server_fraction`); `by_pid`: why `pinning_outcome` could not tell; `cap`: its KV pool's
    cap (`kv_cap`). A GPU dvfs does not meter that took the server's claim while every
    metered one took nothing (with room to) is refused (`EngineError`), unless the cap leaves
    the server less than its claim."""
    share, known = fraction
    was = {_key(g): g for g in before}
    took: dict[str, tuple[GpuProcesses, int, str, float]] = {}
    unread: list[str] = []
    for gpu in after:
        earlier = was.get(_key(gpu))
        nonsense = _nonsense(gpu) or (_nonsense(earlier) if earlier is not None else "")
        if earlier is None or earlier.used_bytes is None or gpu.used_bytes is None or nonsense:
            why = nonsense or gpu.memory_why or (earlier.memory_why if earlier is not None else "")
            unread.append(f"GPU {gpu.index}" + (f" ({why})" if why else ""))
            continue
        grown, evidence = _took(earlier, gpu)
        took[_key(gpu)] = (gpu, grown, evidence, share * (gpu.total_bytes or 0))

    def grew(uuid: str) -> bool:
        _, grown, _, claim = took[uuid]
        return claim >= MIN_CLAIM_BYTES and grown >= CLAIM_SHARE * claim

    def named(uuid: str) -> str:
        gpu, grown, evidence, _ = took[uuid]
        return f"GPU {gpu.index} ({gpu.uuid}) {evidence}"

    def had_room(uuid: str) -> bool:
        """Whether the GPU had room to show the server's claim: SGLang fills it up to its
        claim, so memory held there before (an earlier server's still being freed, a
        tenant's) leaves the growth short of it."""
        held = was[uuid].used_bytes or 0
        return held <= (1 - CLAIM_SHARE) * took[uuid][3]

    ours = [u for u in metered if u in took]
    strays = [u for u in took if u not in metered and grew(u)]

    def took_nothing(uuid: str) -> bool:
        """Whether the GPU took next to nothing (under `MIN_CLAIM_BYTES`, tenants' noise):
        the server there would take more whatever was held before. SGLang claims its share
        of the memory free as it starts, so a tenant's job ending before the server answers
        leaves the growth short of the claim, but never near nought."""
        return took[uuid][1] < MIN_CLAIM_BYTES

    capped = f"--max-total-tokens {cap} caps the server's KV pool" if cap is not None else ""
    if strays and ours and not capped and all(took_nothing(u) and had_room(u) for u in ours):
        gpu, _, _, claim = took[strays[0]]
        where = "; ".join(named(u) for u in strays)
        mine = "; ".join(named(u) for u in ours) or "none readable"
        raise EngineError(
            f"the {drafter!r} server's memory went to {where} as it started, a GPU dvfs does "
            f"not meter (the server's claim there: {_gib(claim)}, {known}), not to the metered "
            f"({mine}): {WRAPPER_FIX}"
        )
    missing = [u for u in metered if u not in {g.uuid for g in after}]
    cannot = [f"NVML lists no GPU {u}" for u in missing]
    if unread:
        cannot.append("NVML cannot read the memory of " + ", ".join(unread))
    small = [u for u in ours if took[u][3] < MIN_CLAIM_BYTES]
    if small:
        cannot.append(
            "the server's claim on "
            + ", ".join(f"GPU {took[u][0].index}" for u in small)
            + f" ({known}) is under {_gib(MIN_CLAIM_BYTES)}, within tenants' memory noise"
        )
    short = [u for u in ours if u not in small and not grew(u)]
    if short:
        cannot.append(
            "the metered "
            + "; ".join(f"{named(u)} of the server's {_gib(took[u][3])} claim" for u in short)
            + f" ({known}) as it started, under {CLAIM_SHARE:.0%} of it ("
            + (
                f"{capped}: it takes only its weights and that pool, not its claim; or "
                if capped
                else ""
            )
            + "memory held there before, another tenant's or an earlier server's not yet "
            "freed, left SGLang less room; or the server is elsewhere)"
        )
    if strays:
        cannot.append(
            "; ".join(named(u) for u in strays)
            + " as it started too, a GPU dvfs does not meter (another tenant's job starting "
            "meanwhile, or part of the server)"
        )
    if cannot:
        return f"unverified: {by_pid}; memory cannot tell: " + "; ".join(cannot)
    quiet = max((took[u][1] for u in took if u not in metered), default=0)
    return (
        "verified by memory: "
        + "; ".join(named(u) for u in ours)
        + f" as the server started, of its {_gib(max(took[u][3] for u in ours))} claim "
        f"({known}), and no GPU dvfs does not meter more than {_gib(max(quiet, 0))} (PIDs "
        f"could not tell: {by_pid})"
    )
