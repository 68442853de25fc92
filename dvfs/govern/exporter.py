"""Live metrics in the Prometheus text format, served on a loopback port by default.

The loop that reads the GPUs and the server publishes a `Snapshot` each interval; the HTTP
thread only renders the latest one, so a scrape never touches NVML or the server and never
waits on them. Units are Prometheus' base units (watts, joules, hertz). Series, each labelled
by `gpu` (index) and `uuid`:

  dvfs_gpu_up (1: the GPU answered this interval's NVML read, 0: it did not),
  dvfs_gpu_power_watts, dvfs_gpu_energy_joules_total (NVML's counter since driver load),
  dvfs_gpu_sm_clock_hertz, dvfs_gpu_power_limit_watts (enforced), dvfs_gpu_sm_clock_lock_max_hertz
  (0 when dvfs holds no lock), dvfs_gpu_sm_clock_lock_by_governor (1: that lock is the
  governor's, 0: the static caps'), dvfs_gpu_energy_per_token_joules (this GPU's energy over the
  server's generated tokens in the last interval; NaN with no token, and on a GPU found not to
  be the server's)

A reading the GPU does not support is NaN, but for the energy counter, left out (a counter
never carries NaN); a GPU that did not answer has dvfs_gpu_up 0 and its
NVML readings (power, energy, clock, power limit, energy per token) left out until it answers
again, not NaN (a counter's rate() would carry a NaN); its lock series, from dvfs's records,
stay. A GPU that did not open as the monitor started has dvfs_gpu_up 0 alone, its uuid empty (its
gpu empty instead where it was named by UUID: `LiveMetrics.unopened`).

and for the server: dvfs_server_up, dvfs_server_read_failures_total (reads that failed),
dvfs_server_running_requests,
dvfs_server_generated_tokens_total, dvfs_server_spec_accept_length (with speculation),
dvfs_server_energy_per_token_joules (its GPUs: those --gpu names, else those it is found on,
else every GPU read, `dvfs.govern.servergpus`; NaN where one of those did not answer,
or did not open as the monitor started); for the governor: dvfs_govern_changes_total
and dvfs_govern_plan_batch (the largest planned batch the band in force reaches; 0 when it
reaches above the plan, at stock); and dvfs_last_read_timestamp_seconds (when the reads this
page holds ended: it stops advancing while one hangs, an NVML call that does not return).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dvfs.errors import DvfsError
from dvfs.govern.metrics import GpuReading

DEFAULT_LISTEN = "127.0.0.1:9435"


class ExporterError(DvfsError):
    """The metrics port cannot be opened."""


@dataclass(frozen=True)
class GpuRow:
    reading: GpuReading
    energy_per_token_j: float = math.nan
    lock_max_mhz: int | None = None
    lock_by_governor: bool = False


@dataclass(frozen=True)
class Snapshot:
    gpus: tuple[GpuRow, ...] = ()
    server_up: bool | None = None  # None: no server is watched
    running: int | None = None
    generated_tokens: float | None = None
    accept_length: float | None = None
    energy_per_token_j: float = math.nan
    governed: bool = False
    changes: int = 0
    plan_batch: int = 0
    #: reads of the server's /metrics that failed since the start
    server_read_failures: int = 0


@dataclass
class LiveMetrics:
    """The latest snapshot, shared between the loop (writer) and the HTTP thread (reader)."""

    _snapshot: Snapshot = field(default_factory=Snapshot)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: GPUs (NVML indices, or the UUIDs they were named by) that did not open as the monitor
    #: started: exported with dvfs_gpu_up 0 (and an empty uuid, or an empty gpu for one named
    #: by UUID: it could not be read) for as long as it runs, so that an alert on
    #: dvfs_gpu_up == 0 does not clear when the monitor restarts without them.
    unopened: tuple[int | str, ...] = ()
    #: The wall clock each snapshot is stamped with as it is published (tests: a fake one).
    clock: Callable[[], float] = time.time
    _published_at: float | None = None

    def publish(self, snapshot: Snapshot) -> None:
        stamp = self.clock()
        with self._lock:
            self._snapshot, self._published_at = snapshot, stamp

    def latest(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def stamped(self) -> tuple[Snapshot, float | None]:
        """The latest snapshot and when it was published (None: nothing yet)."""
        with self._lock:
            return self._snapshot, self._published_at


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


class LiveCollector:
    """A prometheus_client collector rendering the latest snapshot."""

    def __init__(self, live: LiveMetrics) -> None:
        self.live = live

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap, stamp = self.live.stamped()
        labels = ["gpu", "uuid"]
        if stamp is not None:
            # The page serves the latest snapshot for as long as no new one comes: a read that
            # never returns (an NVML call hung on a GPU in a bad state) left it saying the
            # GPUs answered, with their last numbers, for ever. This stops advancing instead.
            yield GaugeMetricFamily(
                "dvfs_last_read_timestamp_seconds",
                "Unix time the latest reads of the GPUs and the server ended, whose numbers "
                "this page holds; it stops advancing while a read hangs.",
                value=stamp,
            )

        # A GPU that did not answer this interval's read has no reading: its series of NVML
        # readings are left out (not NaN, which a counter's rate() would carry), and
        # dvfs_gpu_up says it did not answer; the lock series come from dvfs's records.
        answered = [row for row in snap.gpus if row.reading.error is None]

        def gpu_gauge(name: str, doc: str, value: Any, rows: Any = answered) -> Any:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for row in rows:
                family.add_metric([str(row.reading.index), row.reading.uuid], value(row))
            return family

        up = gpu_gauge(
            "dvfs_gpu_up",
            "1 when the GPU answered this interval's NVML read, 0 when it did not (fallen off "
            "the bus, needing a reset, a driver error: its readings are left out).",
            lambda r: 0.0 if r.reading.error is not None else 1.0,
            snap.gpus,
        )
        for gpu in self.live.unopened:
            up.add_metric([str(gpu), ""] if isinstance(gpu, int) else ["", gpu], 0.0)
        yield up
        yield gpu_gauge("dvfs_gpu_power_watts", "Board power.", lambda r: _nan(r.reading.power_w))
        energy = CounterMetricFamily(
            "dvfs_gpu_energy_joules", "NVML energy counter (since driver load).", labels=labels
        )
        for row in answered:
            if row.reading.energy_j is None:
                # no energy counter on this GPU: left out, a NaN counter would carry into
                # every rate() and sum() over it (the other GPUs' included)
                continue
            ident = [str(row.reading.index), row.reading.uuid]
            energy.add_metric(ident, row.reading.energy_j)
        yield energy
        yield gpu_gauge(
            "dvfs_gpu_sm_clock_hertz",
            "SM clock.",
            lambda r: math.nan if r.reading.sm_clock_mhz is None else r.reading.sm_clock_mhz * 1e6,
        )
        yield gpu_gauge(
            "dvfs_gpu_power_limit_watts",
            "Enforced power limit.",
            lambda r: _nan(r.reading.power_limit_w),
        )
        yield gpu_gauge(
            "dvfs_gpu_sm_clock_lock_max_hertz",
            "Upper end of the SM clock lock dvfs applied (0: none).",
            lambda r: 0.0 if r.lock_max_mhz is None else r.lock_max_mhz * 1e6,
            snap.gpus,
        )
        yield gpu_gauge(
            "dvfs_gpu_sm_clock_lock_by_governor",
            "1 when the SM clock lock is the governor's (dvfs govern), 0 when it is the static "
            "caps' (dvfs cap apply) or there is none.",
            lambda r: 1.0 if r.lock_by_governor else 0.0,
            snap.gpus,
        )
        yield gpu_gauge(
            "dvfs_gpu_energy_per_token_joules",
            "This GPU's energy per token the server generated, over the last interval.",
            lambda r: r.energy_per_token_j,
        )
        if snap.server_up is not None:
            yield from self._server(snap)
        if snap.governed:
            yield CounterMetricFamily(
                "dvfs_govern_changes", "Settings the governor changed.", value=snap.changes
            )
            yield GaugeMetricFamily(
                "dvfs_govern_plan_batch",
                "Largest planned batch the band in force reaches (0: above the plan, stock).",
                value=snap.plan_batch,
            )

    @staticmethod
    def _server(snap: Snapshot) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily(
            "dvfs_server_up",
            "Whether the server's /metrics answered.",
            value=int(bool(snap.server_up)),
        )
        yield CounterMetricFamily(
            "dvfs_server_read_failures",
            "Reads of the server's /metrics that failed (not answering, timed out, not "
            "SGLang's page) since the start.",
            value=snap.server_read_failures,
        )
        yield GaugeMetricFamily(
            "dvfs_server_running_requests",
            "Running requests (the batch) the server reports.",
            value=_nan(snap.running),
        )
        if snap.generated_tokens is not None:
            yield CounterMetricFamily(
                "dvfs_server_generated_tokens",
                "Generated tokens the server reports.",
                value=snap.generated_tokens,
            )
        if snap.accept_length is not None:
            yield GaugeMetricFamily(
                "dvfs_server_spec_accept_length",
                "Speculative accept length the server reports.",
                value=snap.accept_length,
            )
        yield GaugeMetricFamily(
            "dvfs_server_energy_per_token_joules",
            "Energy of the server's GPUs (those --gpu names, else those it was found on, else "
            "all those dvfs reads) per generated token, over the last interval.",
            value=snap.energy_per_token_j,
        )


def registry_for(live: LiveMetrics) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(live))
    return registry


def render(live: LiveMetrics) -> str:
    """The exposition text of the latest snapshot (what a scrape of the port returns)."""
    from prometheus_client import generate_latest

    return generate_latest(registry_for(live)).decode("utf-8")


def parse_listen(value: str) -> tuple[str, int] | None:
    """HOST:PORT (or "off") from the command line; ExporterError says what is wrong."""
    if value.strip().lower() == "off":
        return None
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ExporterError(
            f"--listen must be HOST:PORT (e.g. {DEFAULT_LISTEN}) or off, got {value!r}"
        )
    try:  # as the socket layer encodes the name: one it cannot ("a..b") is no host
        host.encode("idna")
    except UnicodeError as exc:
        raise ExporterError(
            f"--listen {value!r} names no host that can be looked up ({exc})"
        ) from exc
    return host, int(port)


#: How long `Exporter.close` waits for the serving loop to stop before waking it again.
WAKE_S = 0.05


@dataclass
class Exporter:
    """A running metrics endpoint; `close` stops it."""

    server: Any
    thread: threading.Thread
    host: str

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, at once: the serving loop (prometheus_client's `serve_forever`) looks
        for a shutdown only between its 0.5-s waits for a connection, which every `dvfs govern`
        and `dvfs monitor` waited out as it exited; a connection made to it ends that wait
        (it reads as no request), so it is woken until the shutdown is seen."""
        stopping = threading.Thread(target=self.server.shutdown, daemon=True)
        stopping.start()
        while stopping.is_alive():
            self._wake()
            stopping.join(WAKE_S)
        self.server.server_close()
        self.thread.join(timeout=5)

    def _wake(self) -> None:
        """Connect to the listening socket (a wildcard address by its loopback) and hang up."""
        import socket

        host, *rest = self.server.server_address
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        with contextlib.suppress(OSError), socket.socket(self.server.address_family) as s:
            s.settimeout(WAKE_S)
            s.connect((host, *rest))


def start_exporter(live: LiveMetrics, host: str, port: int) -> Exporter:
    """Serve `live` on host:port (port 0: any free port) in a background thread."""
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=registry_for(live))
    except OSError as exc:
        raise ExporterError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose another "
            "--listen HOST:PORT, or --listen off"
        ) from exc
    return Exporter(server, thread, host)
