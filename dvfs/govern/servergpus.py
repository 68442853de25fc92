"""Which GPUs the SGLang server at --url runs on, for its energy per token when no --gpu says.

On a node running one server per GPU (or per tensor-parallel group), the node's energy over one
server's tokens overstates its energy per token several times. Where the server is local, the
process listening on the URL's port (/proc/net/tcp and the processes' fds), its process tree
and NVML's compute processes of each GPU say where it runs. Where they cannot tell (a remote
URL, /proc not readable, no process of the server on any GPU yet), every GPU is counted, with
one warning line. `ServerGpus` follows the server: the listener is looked at again each
interval (one /proc read) and the GPUs found again when it is another process (a restart);
GPUs found are looked for again until found the same twice in a row, `RETRY_S` apart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dvfs.errors import GpuError
from dvfs.gpu.base import Gpu, gpu_names
from dvfs.procfs import (
    PROC,
    connect_addresses,
    is_local,
    listening_sockets,
    port_holders,
    process_name,
    server_pids,
    start_ticks,
)
from dvfs.redact import redact_url

#: How often, at most, a search that found nothing for a reason that may pass (no listener,
#: no GPU process yet) is tried again.
RETRY_S = 10.0


@dataclass(frozen=True)
class Attribution:
    """The server's GPUs by UUID (None: not found, every GPU counts) and why, for the log.
    `listeners`: the listening processes found, (pid, start ticks), to tell a restart;
    `lasting`: a reason no retry changes (a remote URL)."""

    uuids: frozenset[str] | None
    why: str
    listeners: tuple[tuple[int, int | None], ...] = ()
    lasting: bool = False


def _unreadable(port: int, proc: Path) -> str:
    """Why no process is seen holding the socket listening on `port`: reading a process's fds
    takes ptrace access to it, the same user with no fewer capabilities (or CAP_SYS_PTRACE), so
    root without that capability (the dvfs units) cannot read a server run as root either."""
    why = f"the process listening on port {port} cannot be read in {proc}"
    if os.geteuid() == 0:
        return (
            f"{why} (dvfs runs as root without CAP_SYS_PTRACE, as the dvfs units do, "
            "and the server holds capabilities dvfs does not)"
        )
    return f"{why} (another user's: run dvfs as the server's user or as root)"


def find_server_gpus(url: str, gpus: Sequence[Gpu], proc: Path = PROC) -> Attribution:
    """Where the server at `url` runs among `gpus` (see the module docstring)."""
    import httpx

    shown = redact_url(url)
    try:
        parsed = httpx.URL(url)
        host = parsed.host
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except (httpx.InvalidURL, TypeError, ValueError):
        return Attribution(None, f"{shown} is not a URL dvfs can look up", lasting=True)
    if connect_addresses(host) is None:  # DNS not up yet (a unit started at boot), or a typo
        return Attribution(None, f"{host} does not resolve here (yet)")
    if not is_local(host):
        return Attribution(None, f"the server at {shown} is not on this machine", lasting=True)
    if not listening_sockets(port, proc, host=host):
        return Attribution(None, f"nothing listens on port {port} here yet")
    holders = sorted(port_holders(port, None, proc, host=host))
    if not holders:
        return Attribution(None, _unreadable(port, proc))
    listeners = tuple((pid, start_ticks(pid, proc)) for pid in holders)
    tree: set[int] = set()
    for pid in holders:
        tree |= server_pids(pid, proc)
    found, blind = [], []
    for gpu in gpus:
        try:
            pids = gpu.compute_pids()
        except GpuError:
            pids = None
        if pids is None:
            blind.append(gpu)
        elif pids & tree:
            found.append(gpu)
    pid_text = ", ".join(map(str, holders))
    proxies = [pid for pid in holders if process_name(pid, proc) == "docker-proxy"]
    if not found and proxies:
        # Docker's userland proxy forwards a port published with -p: the server listens in the
        # container's network, and nothing on the host ties the proxy to its processes
        return Attribution(
            None,
            f"port {port} is a container's, forwarded by docker-proxy (pid "
            f"{', '.join(map(str, proxies))}), whose server dvfs cannot follow (run the container "
            "with --network host for dvfs to find it)",
            listeners,
        )
    if not found:
        listed = gpu_names([g for g in gpus if g not in blind]) or "any GPU"
        why = (
            f"NVML lists none of the server's {len(tree)} process(es) (pid {pid_text}, "
            f"listening on port {port}) on {listed} (it has not loaded its weights yet, or a "
            "container's PID namespace hides them)"
        )
        if blind:
            why += f"; it cannot list the processes of {gpu_names(blind)}"
        return Attribution(None, why, listeners)
    why = (
        f"NVML lists the server's processes (pid {pid_text}, listening on port {port}, and its "
        "children) there"
    )
    if blind:
        why += (
            f"; it cannot list the processes of {gpu_names(blind)} (pass --gpu if it runs there "
            "too)"
        )
    return Attribution(frozenset(g.identity.uuid for g in found), why, listeners)


@dataclass
class ServerGpus:
    """The server's GPUs, followed: `refresh` each interval finds them at the first call, again
    when the listener found is gone or another process (the server restarted), and, while not
    found for a reason that may pass, or found on other GPUs than the last time (a
    tensor-parallel server's ranks starting one by one), every `RETRY_S`. Each new finding is
    noted in one line; a fallback to every GPU in one warning line, once until something is
    found."""

    url: str
    gpus: Sequence[Gpu]
    note: Callable[[str], None]
    proc: Path = PROC
    clock: Callable[[], float] = time.monotonic
    find: Callable[[str, Sequence[Gpu], Path], Attribution] = find_server_gpus
    #: The governor's: it governs every GPU of `gpus` all the same, which the line says.
    governing: bool = False
    current: Attribution | None = field(default=None, init=False)
    _searching: bool = field(default=True, init=False)
    _next_try_s: float = field(default=float("-inf"), init=False)
    _warned: bool = field(default=False, init=False)
    #: GPUs found that differ from those known before: looked for again `RETRY_S` on, as a
    #: tensor-parallel server's ranks take their GPUs one by one while it starts.
    _confirming: bool = field(default=False, init=False)

    @property
    def uuids(self) -> frozenset[str] | None:
        """The GPUs that count (None: every GPU)."""
        return None if self.current is None else self.current.uuids

    def _listener_moved(self) -> bool:
        known = self.current
        if known is None or not known.listeners:
            return True
        return any(start_ticks(pid, self.proc) != ticks for pid, ticks in known.listeners)

    def refresh(self) -> None:
        known = self.current
        if known is not None and known.lasting:
            return
        if not self._searching:
            if not self._listener_moved():
                return
            self._searching, self._next_try_s = True, float("-inf")
        elif self._confirming and self._listener_moved():
            self._next_try_s = float("-inf")  # restarted before the GPUs found were confirmed
        now = self.clock()
        if now < self._next_try_s:
            return
        self._next_try_s = now + RETRY_S
        found = self.find(self.url, self.gpus, self.proc)
        if found.uuids is None:
            self._confirming = False  # looked for every RETRY_S until found
            if known is None or known.uuids is None:
                self.current = found
                if not self._warned:
                    self._warned = True
                    self.note(
                        "warning: dvfs_server_energy_per_token_joules counts every GPU "
                        f"({gpu_names(self.gpus)}): {found.why}; pass --gpu with the server's GPUs"
                    )
            # else the server is gone (restarting): its GPUs count until it is found again
            return
        changed = known is None or known.uuids != found.uuids
        if changed:
            mine = [g for g in self.gpus if g.identity.uuid in found.uuids]
            line = (
                f"energy per token counts {gpu_names(mine)}, the server's GPU(s) at "
                f"{redact_url(self.url)}: {found.why}"
            )
            if self.governing and len(mine) < len(self.gpus):
                line += (
                    f"; with no --gpu the governor governs every GPU all the same "
                    f"({gpu_names(self.gpus)}): pass "
                    + " ".join(f"--gpu {g.identity.index}" for g in mine)
                    + " to govern the server's only"
                )
            self.note(line)
        # settled once the same GPUs are found twice in a row
        self.current, self._searching, self._warned = found, changed, False
        self._confirming = changed
