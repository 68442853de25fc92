"""Other tenants on the metered GPUs: compute processes that are not the server's.

NVML's energy counter is per GPU, so another process's work on a metered GPU is counted into
the cell's energy per token, and it competes for SMs and memory bandwidth, changing latency.
The runner lists each metered GPU's compute processes at a cell's start and end (where it reads
the power limits back) and flags the cell `foreign_process` when one is not the server's. Only
where the server's own PIDs are known and NVML lists them (its GPU pinning "verified" by PID,
not "verified by memory"): in a container's PID namespace every PID NVML reports would look
foreign, so there nothing is flagged.

Idle baselines are checked the same way, right before and after each is measured: the
session's opening one (before any server starts, so every compute process then is another
tenant's, even one whose PID a container cannot see) and the per-setting ones (with the
server running: anything not its own). A baseline a tenant overlapped flags the cells whose
above-idle energy subtracts it `idle_baseline_foreign`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dvfs.errors import GpuError
from dvfs.gpu.base import Gpu
from dvfs.measure.meter import Q_FOREIGN_PROCESS, Q_IDLE_BASELINE_FOREIGN
from dvfs.procfs import process_name


@dataclass(frozen=True)
class ForeignProcess:
    """A compute process on a metered GPU that is not the server's, when it was seen."""

    gpu: int
    pid: int
    #: Its command name (/proc/<pid>/comm); None when it is gone or unreadable.
    name: str | None
    #: "start" or "end" of the cell (or in-flight group, or idle baseline).
    at: str

    def to_json(self) -> dict[str, object]:
        return {"gpu": self.gpu, "pid": self.pid, "name": self.name, "at": self.at}


class TenantCheck:
    """Lists the metered GPUs' compute processes that are not the server's. `own_pids`: the
    server's process tree now (None: not known or not visible, so nothing can be told foreign);
    asked again only when NVML lists a PID outside the last answer (a child it spawned since).
    `TenantCheck.none_ours()`: before any server of dvfs's runs, every process is foreign."""

    @classmethod
    def none_ours(cls) -> TenantCheck:
        return cls(frozenset)

    def __init__(self, own_pids: Callable[[], frozenset[int]] | None) -> None:
        self.own_pids = own_pids
        self._ours = own_pids() if own_pids is not None else frozenset()

    def seen(self, gpus: Sequence[Gpu], at: str) -> tuple[ForeignProcess, ...]:
        """The foreign processes on `gpus` now; none where NVML cannot list a GPU's."""
        if self.own_pids is None:
            return ()
        listed: list[tuple[int, frozenset[int]]] = []
        for gpu in gpus:
            try:
                pids = gpu.compute_pids()
            except GpuError:  # a lost or failing GPU fails the cell elsewhere, not here
                pids = None
            if pids:
                listed.append((gpu.identity.index, pids))
        if any(pids - self._ours for _, pids in listed):
            self._ours = self.own_pids()
        return tuple(
            ForeignProcess(index, pid, process_name(pid), at)
            for index, pids in listed
            for pid in sorted(pids - self._ours)
        )


def foreign_quality(seen: Sequence[ForeignProcess]) -> int:
    """foreign_process when another tenant's process was on a metered GPU during the cell."""
    return Q_FOREIGN_PROCESS if seen else 0


def idle_quality(seen: Sequence[ForeignProcess]) -> int:
    """idle_baseline_foreign when another tenant's process was on a metered GPU around the idle
    baseline a cell's above-idle energy subtracts."""
    return Q_IDLE_BASELINE_FOREIGN if seen else 0


def named(seen: Sequence[ForeignProcess]) -> str:
    """The processes seen, each once, as a sweep's note says them: "GPU 0: process 42 (python)"."""
    said: dict[tuple[int, int], str] = {}
    for p in seen:
        name = f" ({p.name})" if p.name else ""
        said.setdefault((p.gpu, p.pid), f"GPU {p.gpu}: process {p.pid}{name}")
    return "; ".join(said.values())
