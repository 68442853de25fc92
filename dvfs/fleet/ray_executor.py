"""The Ray executor: one long-lived actor per GPU group, on any node of a Ray cluster.

Ray is an optional extra (`dvfs[ray]`), imported only here and only when used. Each actor
holds a `Worker` (its GPUs' knobs, locks and state files, its server, its clock): placed with
`num_gpus` on real GPUs (the actor reads which GPUs Ray gave it), or with a custom resource
(`twin_gpu`) for twin GPUs. The driver hands each actor one unit at a time from its queue (a
cell, or an in-flight group), so a faster GPU takes more cells; each finished unit comes back
and is journalled at once. An actor that dies loses only its unit in flight, which goes back
to the queue; its GPUs are restored by its own exit path (a worker that raised closes itself),
or, when its process was killed or a GPU could not be put back, are named for `dvfs gpu reset`
on that node (`unrestored`: the sweep then fails). On the twin the
driver hands units out in GPU-time order, as the local executor does.

Without --address, dvfs starts a Ray instance of its own on this machine, bound to 127.0.0.1
(not the cluster RAY_ADDRESS names, nor one `ray start` left running here), and stops it at
the end; Ray's own authentication settings (RAY_AUTH_MODE and its token)
apply unchanged.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from dvfs.backends import real_gpus, virtual_time
from dvfs.errors import CampaignError, DvfsError, ServerReplacedError
from dvfs.fleet.devices import Group, group_label, one_model
from dvfs.fleet.driver import Fleet, bounded_why
from dvfs.fleet.local import (
    OPEN_TIMEOUT_S,
    OPENING_GRACE_S,
    POLL_S,
    VirtualPacer,
    opening_wait_note,
)
from dvfs.measure.journal import resume_advice
from dvfs.redact import redact_url
from dvfs.signals import HANDLED, Interrupted

#: The custom resource that stands for one twin GPU on a Ray node.
TWIN_RESOURCE = "twin_gpu"
#: Ray's namespace for dvfs's actors (a test or an operator finds them there).
NAMESPACE = "dvfs"
# `OPEN_TIMEOUT_S`: seconds an actor may take to open its GPUs and server before the run
# gives up; `OPENING_GRACE_S`: seconds the actors placed and still opening as the run fails
# are waited for past it (`RayExecutor._finish_opening`), so that they close rather than be
# killed inside `open`; those still opening then are killed, their GPUs named for a reset
# now. Both the local fleet's too (`dvfs.fleet.local`), which waits alike.
#: Seconds the actors are given, all together, to close (stop their servers, restore their
#: GPUs) before those that did not are killed, their GPUs named for `dvfs gpu reset`.
CLOSE_TIMEOUT_S = 1800.0
#: Seconds of waiting for the actors to start before a note says so.
OPEN_NOTE_S = 30.0
#: How the GPUs of an actor killed inside its `open` are named (`_opening`): they never
#: stopped answering, and its open may have set their clocks or not yet, so their reset is
#: to run now, not "once the GPU answers again" (`killed_opening`).
KILLED_OPENING = "killed as it opened them"
#: What a reset of such GPUs does, said with it.
KILLED_OPENING_RESET = (
    "it puts back what the killed open set, and finds nothing to restore where it set nothing"
)


def killed_opening(gpu: str) -> bool:
    """Whether `gpu` (an entry of `RayExecutor.unrestored`) names an actor killed inside its
    `open`, whose GPUs still answer."""
    return gpu.endswith(f"({KILLED_OPENING})")


#: Seconds an actor that died as it started waits for the others to tell their nodes' reset
#: command (`WorkerActor.reset_command`), which its line names.
TOLD_WAIT_S = 10.0


class RayMissingError(DvfsError):
    exit_code = 2


class Asked(NamedTuple):
    """What the driver asked a worker's actor as it ends (its close, what it left changed),
    awaited by `RayExecutor._settle`."""

    actor: Any
    #: Every answer awaited: each of them answered, the actor is read whatever stopped the wait.
    refs: tuple[Any, ...]
    #: Those whose answers are enough to read it once a bounded wait ends (of `refs`); one
    #: read as it answers waits for all of `refs`.
    needed: tuple[Any, ...]
    #: Reads its answers, given which of `refs` answered (`answered(ref)`).
    read: Callable[[Callable[[Any], bool]], None]
    #: What did not come, where the bound ran out: "its close".
    what: str


#: What `import_ray` (`dvfs sweep --executor ray`) and `dvfs doctor --executor ray` say where
#: Ray is not installed.
RAY_MISSING = (
    "--executor ray needs Ray, which is not installed: pip install 'dvfs[ray]' (on every node "
    "of the cluster)"
)


def ray_version() -> str:
    """The version of the Ray installed here (not imported: slow to), for `dvfs doctor
    --executor ray`; `RayMissingError` where there is none, as `import_ray` raises it."""
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("ray") is None:
        raise RayMissingError(RAY_MISSING)
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:  # importable, not installed as a package
        return "(its version unknown)"


#: Ray's switch for a single-machine instance: its node address is then 127.0.0.1 and its
#: servers listen on loopback only (read when Ray is imported, and by the processes it starts).
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


#: How long a --address HOST:PORT is given to accept a connection before the join is refused.
ADDRESS_PROBE_S = 5.0


def no_cluster_error(address: str, why: str) -> DvfsError:
    """The one line for an --address at which no Ray cluster can be joined."""
    return DvfsError(
        f"no Ray cluster to join at --address {address} ({why}): start it first (`ray start "
        "--head` on the head node, `ray start --address HEAD:6379` on the others), or leave "
        "out --address to run Ray on this machine only"
    )


def join_error(address: str, exc: BaseException) -> DvfsError:
    """The one line for a cluster at --address that Ray's join refused other than for want of
    one there: one started with another Ray or Python (Ray's "Version mismatch: ..."), or
    Ray's own failure (a RaySystemError)."""
    text = str(exc).strip()
    versions = re.findall(r"Ray: (\S+)\s+Python: (\S+)", text)
    if text.startswith("Version mismatch") and len(versions) == 2:
        (ray_there, python_there), (ray_here, python_here) = versions
        return DvfsError(
            f"could not join the Ray cluster at --address {address} (another Ray or Python: "
            f"cluster: Ray {ray_there}, Python {python_there}; here: Ray {ray_here}, Python "
            f"{python_here}): run dvfs where they match the cluster's (pip install "
            f"'ray=={ray_there}' on Python {python_there}), or on a node of the cluster"
        )
    return DvfsError(
        f"could not join the Ray cluster at --address {address} ({ray_why(exc)}): check the "
        "cluster (`ray status` on its head node, Ray's logs in /tmp/ray/session_latest/logs "
        "there) and rerun the same command"
    )


def ray_why(exc: BaseException) -> str:
    """A Ray error in a few words: its type and its message's first line (a runtime_env's
    failure's, "Failed to set up runtime environment.", with its traceback's last: why)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    why = lines[0]
    if type(exc).__name__ == "RuntimeEnvSetupError" and len(lines) > 1:
        why = f"{why.rstrip('.')}: {lines[-1].strip()}"
    return f"{type(exc).__name__}: {why}"


def unreachable(address: str, ray: Any = None, timeout_s: float = ADDRESS_PROBE_S) -> str | None:
    """Why nothing listens at the HOST:PORT of --address, found with one TCP connection (None:
    something accepts it, or the address is one Ray resolves itself: "auto", "ray://...").
    Ray's own join of a port nothing listens on retries for about 14 minutes before it gives
    up (20 tries of about 40 s). A loopback host is also tried as Ray joins it, at this node's
    address."""
    if address in ("auto", "local") or "://" in address:
        return None
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not host:
        return None  # Ray's to refuse
    host = host.strip("[]")
    hosts = [host]
    resolve = getattr(
        getattr(getattr(ray, "_private", None), "services", None), "resolve_ip_for_localhost", None
    )
    if resolve is not None:
        with contextlib.suppress(Exception):
            hosts.append(str(resolve(host)))
    reason = ""
    for candidate in dict.fromkeys(hosts):
        try:
            with socket.create_connection((candidate, int(port)), timeout=timeout_s) as conn:
                if tls_enabled() or speaks_grpc(conn):
                    return None
        except OSError as exc:
            reason = reason or f"nothing accepts a connection there: {exc.strerror or exc}"
            continue
        # Ray's join of a port that is not a Ray head's retries as long as of one nothing
        # listens on (the dashboard's 8265 given for the head's 6379, say).
        return (
            "something accepts a connection there but does not answer as a Ray head does: "
            "give the head's GCS port, 6379 unless `ray start --head --port` said otherwise"
        )
    return reason


#: The opening a gRPC client sends (HTTP/2's connection preface, then an empty SETTINGS frame).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def tls_enabled() -> bool:
    """Whether Ray's gRPC runs over TLS here (RAY_USE_TLS): then the head's port is not probed
    beyond its TCP connection."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def speaks_grpc(conn: socket.socket) -> bool:
    """Whether the server at the other end of `conn` answers an HTTP/2 (gRPC) client's opening
    with a SETTINGS frame, as a Ray head's GCS server does."""
    conn.sendall(_HTTP2_PREFACE)
    reply = b""
    try:
        while len(reply) < 9:
            chunk = conn.recv(9 - len(reply))
            if not chunk:
                break
            reply += chunk
    except OSError:  # a timeout, or a reset
        pass
    return len(reply) == 9 and reply[3] == 4


def import_ray(*, local: bool = False) -> Any:
    """Ray, or one line saying how to get it. `local`: Ray is about to be started on this
    machine only, so it is told to stay on loopback."""
    if local:
        os.environ[LOCAL_ONLY_ENV] = "0"
    try:
        import ray
    except ImportError:
        raise RayMissingError(RAY_MISSING) from None
    if local:
        import ray._private.ray_constants as constants

        constants.ENABLE_RAY_CLUSTER = False  # imported before: the switch was already read
    return ray


def unwrapped_signal(call: Any, *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, where a signal handler's exception (Ctrl-C's, or the sweep's
    `Interrupted` on SIGTERM) raised while Ray's compiled code ran comes back as itself: Ray's
    Cython functions (`ray.wait`, `ray.get`) return it as a SystemError ("returned a result with
    an exception set") caused by it, which the sweep took for an internal error (exit 1) and
    an actor's loss, not the signal it was (exit 143, the units in flight journalled)."""
    try:
        return call(*args, **kwargs)
    except SystemError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc.__context__
        if isinstance(cause, KeyboardInterrupt | Interrupted):
            raise cause from None
        raise


class SignalSafe:
    """Ray's module as the executor calls it: `wait` and `get` through `unwrapped_signal`,
    everything else Ray's own."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ray, name)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return unwrapped_signal(self._ray.wait, *args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return unwrapped_signal(self._ray.get, *args, **kwargs)


@contextlib.contextmanager
def signals_kept(ray: Any = None) -> Iterator[None]:
    """Keep this process's handlers of SIGINT, SIGTERM and SIGHUP through `ray.init`, which
    makes SIGTERM exit at once (`sys.exit(15)`): the sweep's own handlers raise, so that a
    SIGTERM (Slurm's at the time limit) journals what the actors finish, writes the partial
    cube and ends 143, as without Ray. While `ray.init` runs, the SIGTERM handlers it sets
    (`sys.exit(15)`, then its head node's, which exits 1) are not set: a SIGTERM while Ray
    starts (scancel) ends 143 too, and the head node's processes go with the driver."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in HANDLED}
    utils: Any = getattr(getattr(ray, "_private", None), "utils", None)
    setter = getattr(utils, "set_sigterm_handler", None)
    if setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if setter is not None:
            utils.set_sigterm_handler = setter
        for s, handler in saved.items():
            if handler is not None:  # None: set outside Python, which cannot put it back
                signal.signal(s, handler)


def placed_group(gpu_ids: Sequence[int | str], *, nvml: ModuleType | None = None) -> Group:
    """The NVML indices of the GPUs Ray gave an actor (`ray.get_gpu_ids()`). Ray's ids are its
    own slots (ints), or the entries of the raylet's CUDA_VISIBLE_DEVICES when it had one:
    indices (taken as NVML's, in PCI bus order like CUDA_DEVICE_ORDER=PCI_BUS_ID), or UUIDs
    (or the prefixes CUDA accepts), looked up through NVML as CUDA_VISIBLE_DEVICES is
    (`dvfs.gpu.visible`)."""
    ids = [str(i).strip() for i in gpu_ids]
    if all(i.isdigit() for i in ids):
        return tuple(int(i) for i in ids)
    from dvfs.gpu.nvml import machine_uuids, nvml_session
    from dvfs.gpu.visible import resolve

    with nvml_session(nvml) as module:
        uuids = machine_uuids(module)
    group: list[int] = []
    for i in ids:
        found = resolve(i, uuids).indices
        if len(found) != 1:
            unread = [str(n) for n, u in enumerate(uuids) if not u]
            lost = (
                f"; perhaps one of GPUs {', '.join(unread)}, fallen off the bus or failing (NVML "
                "cannot read their UUIDs)"
                if unread
                else ""
            )
            raise CampaignError(
                f"Ray gave this actor GPU {i!r}, which names no GPU NVML sees on this node "
                f"({len(uuids)} GPU(s)){lost}: check the raylet's CUDA_VISIBLE_DEVICES"
            )
        group.append(found[0])
    return tuple(group)


class WorkerActor:
    """The actor's body (Ray wraps it with `ray.remote` when the executor runs)."""

    def __init__(self, campaign: Any, group: Group | None, options: dict[str, Any]) -> None:
        self.campaign = campaign
        self.group = group
        self.options = options
        self.worker: Any = None

    def open(self) -> dict[str, Any]:
        from dvfs.fleet.worker import Worker

        group = self.group
        if group is None:  # real GPUs: the ones Ray placed this actor on
            import ray

            group = placed_group(ray.get_gpu_ids())
        label = f"{platform.node()}/{group_label(group)}"
        self.worker = Worker(
            self.campaign,
            group,
            out_dir=Path(self.options["out_dir"]),
            sessions=self.options["sessions"],
            corpora=self.options["corpora"],
            label=label,
            slot=int(self.options.get("slot", 0)),
        )
        return self.worker.open()

    def reset_command(self) -> tuple[str, str]:
        """Its node, and the `dvfs gpu reset` there that reads the state files its worker
        keeps (with --state-dir where the node's $DVFS_STATE_DIR or default chose another
        folder than a plain reset, run with sudo, reads): asked before it opens, so that the
        driver can name it for a GPU this actor leaves changed, even once it died."""
        from dvfs.gpu.safety import default_state_dir, reset_command

        try:
            command = reset_command(default_state_dir())
        except DvfsError:  # its state folder unusable: its worker's opening says why
            command = "`dvfs gpu reset`"
        return platform.node(), command

    def run(self, unit: Any) -> Any:
        try:
            return self.worker.run_unit(unit)
        except BaseException:
            # Restore the GPUs before the driver writes this worker off; what lost it (its
            # GPU off the bus) goes on: a restore that failed after it leaves its state
            # files (`unrestored`) and says why in `close_error`.
            try:
                self.worker.close()
            except Exception as exc:  # noqa: BLE001
                self.closing = exc
            raise

    def close_error(self) -> BaseException | None:
        """What its worker's close raised as a failed unit or open closed it (None if
        nothing)."""
        closing = getattr(self, "closing", None)
        if closing is None and self.worker is not None:
            closing = self.worker.open_close_error
        return closing

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def unrestored(self) -> list[str]:
        """The GPUs (UUIDs) this actor changed and could not put back: their state files are
        still on its node (a GPU that fell off the bus). None on the twin."""
        from dvfs.sweep import unrestored_gpus

        return list(unrestored_gpus(self.campaign)[0])


class ModelProbe:
    """An actor placed as a real-GPU worker is (`num_gpus`), that only reads its GPUs' models
    (Ray wraps it with `ray.remote` when `RayExecutor.models` asks)."""

    def read(self) -> tuple[str, list[tuple[int, str]]] | None:
        """Its worker's label and each GPU's NVML index and model, read as the sweep reads
        them (nothing set, closed); None where NVML cannot open them."""
        import ray

        from dvfs.errors import GpuError
        from dvfs.preflight import read_gpu_names

        group = placed_group(ray.get_gpu_ids())
        try:
            gpus = read_gpu_names(group, allow_mig=True)
        except GpuError:
            return None
        return f"{platform.node()}/{group_label(group)}", gpus


class RayExecutor:
    """Ray actors, one per GPU group (an `Executor`)."""

    def __init__(self, out_dir: Path, *, address: str | None = None) -> None:
        self.out_dir = out_dir
        self.address = address
        #: Each node's GPUs whose settings a worker did not put back (UUIDs, or a worker's
        #: GPUs when its actor died): the sweep fails naming them and `dvfs gpu reset` there.
        self.unrestored: dict[str, list[str]] = {}
        #: What the actors' closes raised (a restore of their GPUs that NVML refused): the
        #: sweep's error line where GPUs were left changed, as one GPU's sweep says it.
        self.close_errors: list[BaseException] = []
        #: Each node's `dvfs gpu reset` that reads its workers' state files (with its
        #: --state-dir where needed), as its actors told it (`WorkerActor.reset_command`).
        self.resets: dict[str, str] = {}
        #: Whether the note that RAY_ADDRESS is not joined was said (by the models' probe:
        #: not again by the run).
        self._address_noted = False
        #: A worker's attached server found replaced (`ServerReplacedError`): the sweep stops
        #: in its line, which says what to restart, where every worker is lost.
        self.replaced: ServerReplacedError | None = None
        #: The first refusal a worker raised in its unit (a dvfs error of an exit code other
        #: than 1: a GPU that needs root, one another process holds), which a rerun would meet
        #: again: the run ends in its line and exit code where cells are left, as the local
        #: fleet's, not "every worker was lost", exit 1.
        self.refusal: DvfsError | None = None
        #: The GPUs of `unrestored` the line the run failed in names (`_check_finished`).
        self._said: dict[str, list[str]] = {}
        #: Each worker's entries of `unrestored` (node, GPU), by its label (`_leave`).
        self._left_by: dict[str, list[tuple[str, str]]] = {}

    def __call__(self, fleet: Fleet, groups: Sequence[Group]) -> None:
        twin = not real_gpus(fleet.campaign)
        with self._ray(groups, twin, fleet.note) as ray:
            self._run(ray, fleet, groups, twin)

    def models(
        self,
        campaign: Any,
        groups: Sequence[Group],
        note: Callable[[str], None] | None = None,
    ) -> list[str] | None:
        """The GPU models (as the GPUs name themselves in a journal's sessions) the run's
        actors would measure on, for the driver to tell whether a finished folder holds their
        cells: twins' from their profiles; real GPUs' read by an actor of the run's placement
        on each (`ModelProbe`: its GPUs read over NVML, nothing opened for a sweep or set),
        said in `note` as the run says it while Ray cannot place them yet. An actor whose GPUs
        cannot be read tells none (a run opening them names them). None where no actor's GPUs
        can be read, or the cluster offers no GPUs a worker could be placed on (a folder rerun
        off the GPU nodes): the folder's cells stand as done."""
        from dvfs.preflight import fleet_models, model_names

        if not real_gpus(campaign):
            return fleet_models(campaign, groups)
        with self._ray(groups, False, note) as ray:
            if not self._servers(ray, campaign.engine.tp_size):
                return None  # no worker would be placed: none of its models is missing
            probe = ray.remote(max_restarts=0, max_task_retries=0)(ModelProbe)
            placements = self._placements(ray, campaign, groups, False)
            actors = [probe.options(**placement).remote() for _, placement in placements]
            try:
                refs = [a.read.remote() for a in actors]
                try:
                    read = self._open(ray, note, refs, "GPU")
                except Exception as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, DvfsError):  # one line and its exit code
                        raise cause from None
                    raise
            finally:
                for actor in actors:
                    ray.kill(actor)
        # An actor whose GPUs NVML cannot open (one fallen off the bus) tells no model: the
        # others' still do (one the folder never measured runs, and the run names that GPU).
        return model_names(campaign, [one_model(label, gpus) for label, gpus in filter(None, read)])

    @contextlib.contextmanager
    def _ray(
        self, groups: Sequence[Group], twin: bool, note: Callable[[str], None] | None
    ) -> Iterator[Any]:
        """Ray, joined at --address or started on this machine (stopped again at the end),
        or the instance this process already runs."""
        ray = SignalSafe(import_ray(local=not self.address))
        started = False
        if not ray.is_initialized():
            if self.address:
                why = unreachable(self.address, ray)
                if why:
                    raise no_cluster_error(self.address, why)
                try:
                    with signals_kept(ray):
                        ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False)
                except ConnectionError as exc:  # an OSError: not about the --out folder
                    why = str(exc).split(". ")[0].rstrip(".")  # not Ray's own CLI advice
                    raise no_cluster_error(self.address, why) from exc
                except Exception as exc:  # another Ray's cluster, Ray's system error
                    raise join_error(self.address, exc) from exc
            else:
                if os.environ.get("RAY_ADDRESS") and note is not None and not self._address_noted:
                    self._address_noted = True
                    note(
                        f"RAY_ADDRESS is set ({os.environ['RAY_ADDRESS']}), but without "
                        "--address dvfs runs Ray on this machine only: pass --address to "
                        "join that cluster"
                    )
                try:
                    # "local": a new instance of this machine's, not RAY_ADDRESS's cluster
                    # nor one `ray start` left running here.
                    with signals_kept(ray):
                        ray.init(
                            address="local",
                            namespace=NAMESPACE,
                            include_dashboard=False,
                            log_to_driver=False,
                            resources={TWIN_RESOURCE: sum(len(g) for g in groups)}
                            if twin
                            else None,
                        )
                except Exception as exc:
                    why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise DvfsError(
                        f"could not start Ray on this machine ({type(exc).__name__}"
                        + (f": {why}" if why else "")
                        + "): see Ray's logs (/tmp/ray/session_latest/logs), or join a "
                        "running cluster with --address"
                    ) from exc
            started = True
        try:
            yield ray
        finally:
            if started:
                ray.shutdown()

    def _placements(self, ray: Any, campaign: Any, groups: Sequence[Group], twin: bool) -> list:
        size = campaign.engine.tp_size
        if twin:
            have = ray.cluster_resources().get(TWIN_RESOURCE, 0)
            need = sum(len(g) for g in groups)
            if have < need:
                raise CampaignError(
                    f"the Ray cluster offers {have:g} {TWIN_RESOURCE} but the campaign's "
                    f"{len(groups)} twin worker(s) need {need}: start the nodes with "
                    f"--resources '{{\"{TWIN_RESOURCE}\": N}}'"
                )
            # A worker's twin GPUs are one node's, as a real server's are: the nodes' own
            # counts must hold the workers whole (on groups of one size; Ray places others).
            sizes = {len(g) for g in groups}
            if len(sizes) == 1:
                size = sizes.pop()
                whole = self._servers(ray, size, TWIN_RESOURCE)
                if whole < len(groups):
                    raise CampaignError(
                        f"the Ray cluster's nodes hold {whole} twin worker(s) of {size} "
                        f"{TWIN_RESOURCE} each, but the campaign has {len(groups)}: its "
                        f"{have:g} {TWIN_RESOURCE} are spread over its nodes, and a worker's "
                        f"GPUs are one node's; give each node a multiple of {size} "
                        f"{TWIN_RESOURCE}, or run fewer twin GPUs (--gpus)"
                    )
            return [(g, {"resources": {TWIN_RESOURCE: len(g)}, "num_cpus": 0}) for g in groups]
        servers = self._servers(ray, size)
        if not servers:
            gpus = int(ray.cluster_resources().get("GPU", 0))
            if gpus < size:
                raise CampaignError(
                    f"the Ray cluster offers {gpus} GPU(s); one server needs engine.tp_size = "
                    f"{size}"
                )
            raise CampaignError(
                f"no node of the Ray cluster has engine.tp_size = {size} GPUs (its {gpus} "
                "GPUs are spread over its nodes), and a server's GPUs are one node's: lower "
                f"engine.tp_size, or add a node of {size} GPUs"
            )
        self._one_attached(campaign, servers)
        return [(None, {"num_gpus": size, "num_cpus": 0}) for _ in range(servers)]

    def check_attached(self, campaign: Any, groups: Sequence[Group]) -> None:
        """Refuse, as the run does before any actor opens a GPU (`_one_attached`), a cluster
        that would place several workers of real GPUs on the one server engine.sglang.url
        attaches: for the dry run, which asks Ray nothing else."""
        if not real_gpus(campaign) or not self._attached_url(campaign):
            return
        with self._ray(groups, False, None) as ray:
            self._one_attached(campaign, self._servers(ray, campaign.engine.tp_size))

    @staticmethod
    def _attached_url(campaign: Any) -> str | None:
        return campaign.engine.sglang.url if campaign.engine.backend == "sglang" else None

    def _one_attached(self, campaign: Any, servers: int) -> None:
        url = self._attached_url(campaign)
        if url and servers > 1:
            # Placed on every server's worth of the cluster's GPUs, not on gpu.devices: as
            # `--gpus` making several workers on one attached server is refused.
            raise CampaignError(
                f"the Ray cluster places {servers} workers (one per engine.tp_size = "
                f"{campaign.engine.tp_size} GPU(s) of its nodes), but engine.sglang.url "
                f"attaches every one to the one server at {redact_url(url)}: each would meter "
                "its own GPUs while all their requests ran on that server; run without "
                "--executor ray on the server's node (gpu.devices naming its GPUs), or drop "
                "engine.sglang.url so that dvfs starts a server per worker"
            )

    @staticmethod
    def _servers(ray: Any, size: int, resource: str = "GPU") -> int:
        """How many servers of `size` GPUs (`resource`: real, or twin) the cluster's live
        nodes hold, each on one node's GPUs: a node's GPUs that do not make a whole server are
        left out (3 GPUs on each of two nodes hold two servers of 2, not three, the third
        waited for in vain)."""
        return sum(
            int(node.get("Resources", {}).get(resource, 0)) // size
            for node in ray.nodes()
            if node.get("Alive")
        )

    def _run(self, ray: Any, fleet: Fleet, groups: Sequence[Group], twin: bool) -> None:
        campaign = fleet.campaign
        options: dict[str, Any] = {
            "out_dir": str(self.out_dir),
            "sessions": [],
            "corpora": fleet.corpora,
        }
        actor_class = ray.remote(max_restarts=0, max_task_retries=0)(WorkerActor)
        actors = []
        for i, (group, placement) in enumerate(self._placements(ray, campaign, groups, twin)):
            name = f"dvfs-{group_label(group) if group else i}"
            actors.append(
                actor_class.options(name=name, lifetime=None, **placement).remote(
                    campaign,
                    group,
                    {**options, "slot": i},  # its servers' block of ports
                )
            )
        alive: dict[str, Any] = {}
        told: list[Any] = []
        try:
            # Asked first (an actor answers in order): known even for one that dies opening.
            told = [] if twin else [a.reset_command.remote() for a in actors]
            refs = [a.open.remote() for a in actors]
            opens_due = time.monotonic() + OPEN_TIMEOUT_S  # as `_open` bounds them

            def reset() -> str:
                # A worker's actor may die once it changed its GPUs (a measured settle);
                # an --observe-only one changes none.
                if twin or not campaign.gpu.actuation:
                    return ""
                # The dead actor's own word, where it told (its node's reset: nodes differ)
                command = self._told_by_dead(ray, refs, told)
                if command is None:
                    self._told(ray, told, TOLD_WAIT_S)  # the others answer as they start
                    commands = set(self.resets.values())
                    command = commands.pop() if len(commands) == 1 else "`dvfs gpu reset`"
                return f"; its GPUs may keep settings it set: {command} there"

            try:
                resource = TWIN_RESOURCE if twin else "GPU"
                sessions = self._open(ray, fleet.note, refs, resource, reset)
                # Noted as opened here, inside the guard: a signal landing once their sessions
                # came back, before they were noted, left every actor unclosed and unnamed.
                order = sorted(range(len(actors)), key=lambda i: str(sessions[i]["worker"]))
                sessions = [sessions[i] for i in order]
                alive = {str(s["worker"]): actors[i] for s, i in zip(sessions, order, strict=True)}
            except BaseException as exc:  # noqa: BLE001  (re-raised: Ctrl-C too)
                signalled: BaseException | None = None
                if not isinstance(exc, KeyboardInterrupt | Interrupted):
                    # The run failed (not a signal): those placed and still opening finish
                    # opening and close below, as the local fleet's workers do, their GPUs
                    # restored, not killed as the open left them. A signal as they are
                    # waited for stops the wait, and is what the run ends in (its exit code).
                    bound = max(OPENING_GRACE_S, opens_due - time.monotonic())
                    signalled = self._finish_opening(ray, fleet, refs, told, bound)
                # Those that opened (their GPUs' knobs may be changed: the settle measured)
                # close before the run fails, as when the sweep ends.
                alive, answered = self._opened(ray, dict(zip(refs, actors, strict=True)))
                # Those still inside `open` are killed with the run (a measured settle may
                # have set their clocks): named, with their node's reset. By the same look as
                # those that opened: an open that answered between two looks was in neither.
                self._opening(ray, campaign, refs, told, answered)
                # Those whose open raised (their worker closed itself): asked which GPUs they
                # left changed and what that close raised, as a worker that raised in a unit.
                # By the same look again: one whose open raised since is named as opening.
                self._failed_opens(
                    ray, campaign, dict(zip(refs, actors, strict=True)), told, answered
                )
                if signalled is not None:  # 130 or 143, and the GPUs left changed named
                    raise signalled from None
                cause = getattr(exc, "cause", None)
                if isinstance(cause, DvfsError):  # one line and its exit code, as locally
                    raise cause from None
                raise
            fleet.open(sessions)
            self._told(ray, told)
            self._drive(ray, fleet, alive, virtual_time(campaign))
        finally:
            try:
                self._close(ray, campaign, alive)  # those opened, where `_drive` closed none
            finally:
                # Those that answered, however the run ended (a signal as they opened): the
                # line naming GPUs left changed gives their node's reset.
                with contextlib.suppress(Exception):
                    self._told(ray, told)
                for actor in actors:
                    ray.kill(actor)

    def _close(
        self,
        ray: Any,
        campaign: Any,
        alive: dict[str, Any],
        retiring: dict[str, Asked] | None = None,
    ) -> None:
        """Close each actor of `alive` (it restores its GPUs) and note the GPUs any left
        changed; the lost workers' actors of `retiring` (`_drive`'s, asked what they left
        changed) are awaited with them, and dropped from it. The closes are asked of every
        actor at once and awaited together, with the lost ones' answers, under one bound
        (`CLOSE_TIMEOUT_S`, `_settle`), so the actors stop their servers and restore their GPUs
        side by side (a fleet's end waits for the slowest, not for the sum, nor for the lost
        ones first): each was waited for in turn, half an hour each. A further signal as they
        are asked gives up waiting, as one while they close (`_give_up`)."""
        asked: dict[str, Asked] = {} if retiring is None else retiring
        try:
            for label, actor in alive.items():
                asked[label] = self._closing(ray, campaign, label, actor)
        except BaseException:
            for label in alive:
                if label not in asked:  # not asked: given up, as the rest
                    self._note_died(campaign, label, "its close was given up")
            self._give_up(ray, campaign, asked)
            raise
        self._settle(ray, campaign, asked, CLOSE_TIMEOUT_S)

    def _closing(
        self, ray: Any, campaign: Any, label: str, actor: Any, *, failed: bool = False
    ) -> Asked:
        """`label`'s actor asked to close (Ray's failure of its unit left it alive, its GPUs
        set; or the run's end) and, once it has (an actor answers in order), which GPUs it
        left changed: read once its close answered. `failed`: Ray failed its unit, inside
        which its worker may have raised and closed itself (its close now a no-op): what that
        close raised (`close_error`, a restore NVML refused for want of root) is asked too, as
        `_raised` asks it, and kept in `close_errors` (the cause said, exit 4 for root)."""
        closing, left = actor.close.remote(), actor.unrestored.remote()
        raised = actor.close_error.remote() if failed else None

        def read(answered: Callable[[Any], bool]) -> None:
            self._closed(ray, campaign, label, closing, left if answered(left) else None)
            if raised is not None and answered(raised):
                with contextlib.suppress(Exception):  # a dead actor: its close said so
                    error = ray.get(raised)
                    if error is not None:
                        self.close_errors.append(error)

        refs = (closing, left) if raised is None else (closing, left, raised)
        return Asked(actor, refs, (closing,), read, "its close")

    def _settle(self, ray: Any, campaign: Any, asked: dict[str, Asked], bound: float) -> None:
        """Read the actors of `asked` whose answers came within `bound` (0: those that
        answered by now), and drop them from it. All are awaited in one wait, however many;
        with a bound (> 0), those that did not answer in it (their node cut off, a restore
        stuck) are killed, their GPUs named as left changed with their node's reset. A signal
        while they are awaited gives up waiting (`_give_up`)."""
        if not asked:
            return
        done: list[str] = []
        waited = False
        try:
            refs = [ref for entry in asked.values() for ref in entry.refs]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=bound)
            waited = True
            for label, entry in asked.items():
                # Read as it answers: once all of it has (a close that answered before its
                # word on the GPUs it left changed is not read as restored: that word comes).
                if all(ref in ready for ref in (entry.refs if bound <= 0 else entry.needed)):
                    entry.read(lambda ref: ref in ready)
                elif bound <= 0:
                    continue
                else:  # its close still runs (its node cut off, a restore stuck): given up
                    with contextlib.suppress(Exception):
                        ray.kill(entry.actor)
                    self._note_died(
                        campaign, label, f"{entry.what} did not come within {bound:g} s"
                    )
                done.append(label)
        except BaseException:
            if bound > 0:  # a signal as they closed
                for label in done:
                    asked.pop(label, None)
                done = []
                self._give_up(ray, campaign, asked, read=not waited)
            raise
        finally:
            for label in done:
                asked.pop(label, None)

    def _give_up(
        self, ray: Any, campaign: Any, asked: dict[str, Asked], *, read: bool = True
    ) -> None:
        """A signal as the actors of `asked` close: those that answered by now are read (with
        `read`), and the others are given up (killed with the run, their GPUs as they set them,
        which the sweep's last line names); `asked` is left empty."""
        try:
            if asked and read:
                refs = [ref for entry in asked.values() for ref in entry.refs]
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for label, entry in list(asked.items()):
                    if all(ref in ready for ref in entry.refs):
                        entry.read(lambda ref: ref in ready)
                        asked.pop(label)
        except Exception:  # noqa: BLE001, S110  (not known: given up, as the rest)
            pass
        finally:
            for label in asked:
                self._note_died(campaign, label, "its close was given up")
            asked.clear()

    def _closed(self, ray: Any, campaign: Any, label: str, closing: Any, left: Any | None) -> None:
        """Note what the close `closing` of `label`'s actor answered, and the GPUs it left
        changed (`left`: its `unrestored`, None where it did not answer in time)."""
        try:
            ray.get(closing)
        except Exception as exc:  # noqa: BLE001  (a close that raised: its `unrestored` tells)
            cause = getattr(exc, "cause", None)
            if actor_gone(exc):  # killed after its last unit, before it could close
                self._note_died(campaign, label)
                return
            if not isinstance(cause, BaseException):  # Ray's own (its system error)
                self._note_died(campaign, label, f"its close failed: {ray_why(exc)}")
                return
            self.close_errors.append(cause)  # what the worker raised
            if left is None:  # which GPUs it left changed is not known: all of them
                self._note_died(campaign, label, f"its close failed: {type(cause).__name__}")
                return
        if left is None:  # its close answered: it restored its GPUs
            return
        with contextlib.suppress(Exception):  # a dead actor: its close said so
            self._leave(label, ray.get(left) or ())

    def _opening(
        self, ray: Any, campaign: Any, refs: list[Any], told: list[Any], opened: list[Any]
    ) -> None:
        """Note the GPUs of the actors still inside `open` (of `refs`) as the run stops: they
        are killed with it, their GPUs as their opening left them (a measured settle sets
        their clocks; their state files kept). Those that told their node (`told`, in the same
        order: placed and started) and whose open had not answered (is not in `opened`, the
        look `_opened` took: one answering since is neither closed nor skipped); not on the
        twin, nor --observe-only, which sets nothing."""
        if not told or not real_gpus(campaign) or not campaign.gpu.actuation:
            return
        try:
            started, _ = ray.wait(told, num_returns=len(told), timeout=0)
            for i, (ref, answer) in enumerate(zip(refs, told, strict=False)):
                if ref in opened or answer not in started:
                    continue
                with contextlib.suppress(Exception):  # it died before it answered
                    host = str(ray.get(answer)[0])
                    self._leave(
                        f"{host}/dvfs-{i}",
                        [f"the GPUs of Ray actor dvfs-{i} ({KILLED_OPENING})"],
                    )
        except Exception:  # noqa: BLE001, S110  (Ray cannot tell: the run's own line goes on)
            pass

    def _finish_opening(
        self, ray: Any, fleet: Fleet, refs: list[Any], told: list[Any], bound: float
    ) -> BaseException | None:
        """Wait (within `bound` s, said in one note) for the opens (`refs`) of the actors that
        told their node (`told`, in the same order: placed and started) as the run fails, so
        that they close rather than be killed inside `open`. Not those never placed (which may
        wait for GPUs for good), nor on the twin or --observe-only (nothing to restore). A
        signal stops the wait and is returned, for the run to end in: those still opening are
        then killed and named, as when a signal lands as they open."""
        campaign = fleet.campaign
        if not told or not real_gpus(campaign) or not campaign.gpu.actuation:
            return None
        try:
            started, _ = ray.wait(told, num_returns=len(told), timeout=0)
            placed = [ref for ref, answer in zip(refs, told, strict=False) if answer in started]
            if not placed:
                return None
            _, opening = ray.wait(placed, num_returns=len(placed), timeout=0)
            if opening:
                fleet.note(opening_wait_note("Ray workers", bound, len(opening)))
                ray.wait(opening, num_returns=len(opening), timeout=bound)
        except (KeyboardInterrupt, Interrupted) as exc:
            return exc
        except Exception:  # noqa: BLE001, S110  (Ray cannot tell: those opening are named)
            pass
        return None

    def _failed_opens(
        self,
        ray: Any,
        campaign: Any,
        actors: dict[Any, Any],
        told: list[Any],
        answered: list[Any],
    ) -> None:
        """Note the GPUs the actors whose `open` (a ref of `actors`) raised their worker's
        error left changed, and what their close raised (`_raised`): its open closed its
        worker, which may have failed to restore what the open set. Those of `answered`
        alone (the look `_opened` took): one answering since is named by `_opening`, as
        still opening (a second look named its GPUs twice). Not on the twin, nor
        --observe-only, which sets nothing."""
        if not told or not real_gpus(campaign) or not campaign.gpu.actuation:
            return
        asked: dict[str, Asked] = {}
        try:
            for i, (ref, answer) in enumerate(zip(actors, told, strict=False)):
                if ref not in answered:
                    continue
                try:
                    ray.get(ref)
                    continue  # opened: closed with the others
                except Exception as exc:  # noqa: BLE001
                    if actor_gone(exc) or ray_failure(exc) is not None:
                        continue  # its open's line, or `_opening`, says it
                host = "?"
                with contextlib.suppress(Exception):  # it died before it answered
                    host = str(ray.get(answer)[0])
                label = f"{host}/dvfs-{i}"
                asked[label] = self._raised(ray, label, actors[ref])
        except Exception:  # noqa: BLE001, S110  (Ray cannot tell: the run's own line goes on)
            pass
        self._settle(ray, campaign, asked, CLOSE_TIMEOUT_S)

    def _told(self, ray: Any, told: list[Any], wait_s: float = 0.0) -> None:
        """Note the reset commands (`WorkerActor.reset_command`) the actors answered by now
        (or within `wait_s`)."""
        if not told:
            return
        ready, _ = ray.wait(told, num_returns=len(told), timeout=wait_s)
        for ref in ready:
            with contextlib.suppress(Exception):  # its actor died before it answered
                host, command = ray.get(ref)
                self.resets[str(host)] = str(command)

    @staticmethod
    def _told_by_dead(ray: Any, refs: list[Any], told: list[Any]) -> str | None:
        """The reset command an actor whose `open` (of `refs`) found it dead, or answered with
        Ray's own error (`ray_failure`: the actor may live on, its GPUs set), had told
        (`told`, in the same order) before; None where none had."""
        for ref, answer in zip(refs, told, strict=False):
            try:
                ready, _ = ray.wait([ref], num_returns=1, timeout=0)
                if ready:
                    ray.get(ready)
            except Exception as exc:  # noqa: BLE001
                if actor_gone(exc) or ray_failure(exc) is not None:
                    with contextlib.suppress(Exception):  # it died before it answered
                        ready, _ = ray.wait([answer], num_returns=1, timeout=0)
                        if ready:
                            return str(ray.get(answer)[1])
        return None

    def reset_on(self, host: str) -> str:
        """The `dvfs gpu reset` to run on `host` (its actors' word; plain where none said)."""
        return self.resets.get(host, "`dvfs gpu reset`")

    @staticmethod
    def _opened(ray: Any, actors: dict[Any, Any]) -> tuple[dict[str, Any], list[Any]]:
        """The actors whose `open` (a ref of `actors`) returned a session by now, by label, and
        the refs that had answered then (a session or an error)."""
        ready, _ = ray.wait(list(actors), num_returns=len(actors), timeout=0)
        opened: dict[str, Any] = {}
        for ref in ready:
            with contextlib.suppress(Exception):  # one that could not open closed itself
                opened[str(ray.get(ref)["worker"])] = actors[ref]
        return opened, list(ready)

    @staticmethod
    def _open(
        ray: Any,
        note: Callable[[str], None] | None,
        refs: list[Any],
        resource: str,
        reset: Callable[[], str] | None = None,
    ) -> list[Any]:
        """Every actor's session, once each is placed and has opened its GPUs. An actor Ray
        cannot place (other jobs hold the cluster's GPUs) waits: said in `note` after
        `OPEN_NOTE_S`, and given up after `OPEN_TIMEOUT_S` in one line; one whose process
        died (its node gone, out of memory) is one line too (`reset`: what it says of the
        GPUs the actor may have left changed)."""
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        noted = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=min(OPEN_NOTE_S, left))
            try:
                ray.get(ready)  # an actor that could not open: its error now, not at the end
                if not waiting:
                    return list(ray.get(refs))
            except Exception as exc:
                failure = None if actor_gone(exc) else ray_failure(exc)
                if failure is not None:
                    # Ray's own (its object store full, a timeout, its system error), not
                    # the worker's: the actor may live on, its GPUs opened, and is killed.
                    started = type(failure).__name__ not in NEVER_STARTED
                    raise DvfsError(
                        f"Ray failed as a worker started ({ray_why(failure)})"
                        f"{reset() if reset is not None and started else ''}; "
                        f"{ray_advice(failure)}"
                    ) from exc
                if not actor_gone(exc):
                    raise
                text = str(exc).strip()
                why = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else ""
                if out_of_memory(exc):
                    raise DvfsError(
                        f"a Ray worker was killed as it started: its node ran out of memory "
                        f"({why or type(exc).__name__})"
                        f"{reset() if reset is not None else ''}; free memory on that node "
                        "(its other jobs) and rerun the same command"
                    ) from exc
                raise DvfsError(
                    f"a Ray worker died as it started ({why or type(exc).__name__}): its node "
                    f"may have gone down or run out of memory (see Ray's logs there)"
                    f"{reset() if reset is not None else ''}; "
                    "rerun the same command once the cluster is whole"
                ) from exc
            free = ray.available_resources().get(resource, 0)
            total = ray.cluster_resources().get(resource, 0)
            if time.monotonic() >= deadline:
                fewer = (
                    "run fewer twin GPUs (--gpus)"
                    if resource == TWIN_RESOURCE
                    else "dvfs places a worker on every GPU the cluster offers"
                )
                raise DvfsError(
                    f"{len(waiting)} of {len(refs)} Ray worker(s) did not start within "
                    f"{OPEN_TIMEOUT_S:g} s ({free:g} of the cluster's {total:g} {resource} "
                    f"free): other jobs may hold them; free them ({fewer})"
                )
            if not noted and note is not None:
                noted = True
                note(
                    f"waiting for {len(waiting)} of {len(refs)} Ray worker(s) to start "
                    f"({free:g} of the cluster's {total:g} {resource} free; other jobs may "
                    f"hold them, or the workers are still opening their GPUs); giving up "
                    f"after {OPEN_TIMEOUT_S:g} s"
                )

    def _drive(self, ray: Any, fleet: Fleet, alive: dict[str, Any], virtual: bool) -> None:
        pacer = VirtualPacer(list(alive), fleet.lanes()) if virtual else None
        drafters: dict[str, str | None] = dict.fromkeys(alive)
        pending: dict[Any, tuple[str, Any]] = {}
        idle = list(alive)
        exhausted: list[str] = []  # found the queue empty; back if a lost cell returns
        times: dict[str, float] = dict.fromkeys(alive, 0.0)
        # Lost workers whose actors are asked what they left changed (closed first where Ray
        # failed their unit), by label: read as they answer, the rest with the closes at the end.
        retiring: dict[str, Asked] = {}

        def feed() -> None:
            # Again while a worker ran out in the pass: it left the pacer, so one that waited
            # behind it may claim now (others may still hold the groups it cannot take).
            again = True
            while again:
                again = False
                for label in list(idle):
                    if pacer is not None and not pacer.claim(label):
                        continue
                    unit = fleet.take(label, drafters[label])
                    if unit is None:
                        idle.remove(label)
                        exhausted.append(label)
                        if pacer is not None:
                            pacer.leave(label)
                        again = True
                        continue
                    idle.remove(label)
                    fleet.started(label, unit)
                    pending[alive[label].run.remote(unit)] = (label, unit)

        try:
            feed()
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    label, unit = pending.pop(ref)
                    try:
                        shipment = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001  (its actor died, or its worker raised)
                        self._lost(fleet, label, unit, exc)
                        actor = alive[label]
                        if not actor_gone(exc) and ray_failure(exc) is exc:
                            # Ray's own (not its worker's raise, which closed it): the actor
                            # lives on, its GPUs set, and is closed before it is killed.
                            retiring[label] = self._closing(
                                ray, fleet.campaign, label, actor, failed=True
                            )
                        else:  # read as it answers: the other workers go on meanwhile
                            retiring[label] = self._raised(ray, label, actor)
                        alive.pop(label)
                        if pacer is not None:
                            pacer.leave(label)
                        for back in exhausted:  # its cell is in the queue again
                            idle.append(back)
                            if pacer is not None:
                                pacer.free(back, times[back])
                        exhausted.clear()
                        continue
                    fleet.shipped(label, shipment)
                    drafters[label] = shipment.cell.drafter
                    times[label] = shipment.gpu_time_s
                    if pacer is not None:
                        pacer.free(label, shipment.gpu_time_s)
                    idle.append(label)
                    for back in [b for b in exhausted if fleet.has_cells(b)]:  # extra repeats
                        exhausted.remove(back)
                        idle.append(back)
                        if pacer is not None:
                            pacer.free(back, times[back])
                self._settle(ray, fleet.campaign, retiring, 0.0)
                feed()
            live = list(alive)  # with cells left: a refusal retired them (its line below)
        except (KeyboardInterrupt, Interrupted):
            # Ctrl-C or SIGTERM: each actor still finishes its unit in flight (its `close`
            # waits behind it), so journal what they finish, as the local executor does,
            # before the interruption goes on (a second signal gives up waiting).
            self._collect(ray, fleet, pending)
            raise
        finally:
            # However the run ends (its failure, a signal), the lost workers' GPUs are known
            # (or named) before it does; the live ones close meanwhile, under the same bound.
            try:
                self._close(ray, fleet.campaign, alive, retiring)
            finally:
                alive.clear()  # closed: not again as the run ends
        if not fleet.finished and self.refusal is not None:
            # A worker's refusal (a rerun would meet it again) keeps its own line and exit
            # code, as the local fleet's; the GPUs the closes left changed are said beside it
            # (`unsaid`, all of them: its line names none).
            raise self.refusal
        if not fleet.finished and not live:
            if self.replaced is not None and not self.unrestored:
                raise self.replaced  # a rerun on that server would meet it again
            # Every worker lost: the cells left, and the resets to run before resuming.
            self._check_finished(fleet)
        if not fleet.finished and live:
            # A refusal's own line, when the driver retired them (with the resets to run
            # first where the others were lost with their GPUs changed); what the retired
            # ones' closes left changed is said beside it, with what their restores raised.
            self._check_finished(fleet, after=live)
            raise DvfsError(
                f"the Ray workers stopped with cells left; {resume_advice(fleet.fresh)}"
            )

    @staticmethod
    def _collect(ray: Any, fleet: Fleet, pending: dict[Any, tuple[str, Any]]) -> None:
        """Journal the units the actors finish once the driver stopped handing them out (a
        unit whose actor died or raised is left for the rerun). Each is journalled as it comes,
        so that a second signal, or a SIGKILL after SIGTERM, while one actor is still on a long
        unit keeps those the others finished."""
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                label, _unit = pending.pop(ref)
                try:
                    shipment = ray.get(ref)
                except Exception:  # noqa: BLE001, S112  (the rerun measures it)
                    continue
                fleet.shipped(label, shipment)

    def _note_died(self, campaign: Any, label: str, why: str = "its actor died") -> bool:
        """Note that `label`'s actor died with its GPUs as it had set them (on real GPUs,
        not --observe-only, which sets nothing)."""
        if not real_gpus(campaign) or not campaign.gpu.actuation:
            return False
        if label in self._left_by:  # named already, by its own word: one GPU, one line
            return True
        self._leave(label, [f"the GPUs of worker {label} ({why})"])
        return True

    def _leave(self, label: str, gpus: Sequence[Any]) -> None:
        """Note `gpus` (UUIDs, or a worker's GPUs in words) as left changed by `label`'s worker,
        on its node."""
        host = label.split("/", 1)[0]
        for gpu in gpus:
            self.unrestored.setdefault(host, []).append(str(gpu))
            self._left_by.setdefault(label, []).append((host, str(gpu)))

    def _raised(self, ray: Any, label: str, actor: Any) -> Asked:
        """`label`'s actor, whose worker raised in its unit (and closed itself), asked which
        GPUs it left changed and what its close raised: read once both answered."""
        unrestored, close_error = actor.unrestored.remote(), actor.close_error.remote()

        def read(answered: Callable[[Any], bool]) -> None:
            self._left(ray, label, unrestored, close_error)

        refs = (unrestored, close_error)
        return Asked(actor, refs, refs, read, "its word on the GPUs it left changed")

    def _left(self, ray: Any, label: str, unrestored: Any, close_error: Any) -> None:
        """Note the GPUs an actor whose worker raised (and closed) left changed (`unrestored`,
        its answer), and what its close raised then (`close_error`)."""
        # Both answers read before either is noted: a signal as the second was read left the
        # first noted, and the actor given up named again (`_give_up`), its GPUs said twice.
        gpus: Sequence[Any] = ()
        closing = None
        with contextlib.suppress(Exception):  # a dead actor: `_lost` said so
            gpus = ray.get(unrestored) or ()
        with contextlib.suppress(Exception):
            closing = ray.get(close_error)
        self._leave(label, gpus)
        if closing is not None:
            self.close_errors.append(closing)

    def _for_root(self, left: dict[str, list[str]]) -> tuple[list[str], bool]:
        """The nodes of `left` (GPUs left changed, by node) where NVML refused a restore of
        one of those GPUs for want of root (`close_errors`), and whether it refused every
        GPU of `left` so (none lost, to reset once it answers again)."""
        from dvfs.errors import GpuPermissionError

        refused = [str(e) for e in self.close_errors if isinstance(e, GpuPermissionError)]
        root = [h for h, gpus in left.items() if any(g in e for g in gpus for e in refused)]
        every = all(any(g in e for e in refused) for gpus in left.values() for g in gpus)
        return root, every

    def unsaid_errors(self) -> list[BaseException]:
        """What the actors' closes raised (`close_errors`), less the errors of GPUs the line
        the run failed in named (`_check_finished`): said beside the GPUs of `unsaid`, an
        error of those named already was said again, as another GPU's."""
        said = [gpu for gpus in self._said.values() for gpu in gpus]
        return [e for e in self.close_errors if not any(gpu in str(e) for gpu in said)]

    def _check_finished(self, fleet: Fleet, after: Sequence[str] = ()) -> None:
        """`fleet.check_finished` with the resets to run first (`reset_first`): the GPUs its
        line names, where it raises one, are said (`unsaid`). Not those the closes of the workers
        of `after` left changed (those a refusal retired): said beside its line, by GPU, with
        what their restores raised (`close_errors`), as when they closed after it."""
        later = [entry for label in after for entry in self._left_by.get(label, [])]
        said: dict[str, list[str]] = {}
        for host, gpus in self.unrestored.items():
            for gpu in gpus:
                if (host, gpu) in later:
                    later.remove((host, gpu))
                else:
                    said.setdefault(host, []).append(gpu)
        try:
            fleet.check_finished(self.reset_first(said))
        except BaseException:
            self._said = said
            raise

    def unsaid(self) -> dict[str, list[str]]:
        """The GPUs of `unrestored` that no line of the run named (those the actors' closes
        left changed after the run failed in its line): the sweep names them beside it."""
        left = {
            host: [gpu for gpu in gpus if gpu not in self._said.get(host, [])]
            for host, gpus in self.unrestored.items()
        }
        return {host: gpus for host, gpus in left.items() if gpus}

    def reset_first(self, left: dict[str, list[str]] | None = None) -> str:
        """Where workers left GPUs changed (`left`: of `unrestored`, all by default): the nodes
        and each one's `dvfs gpu reset`, to run before the sweep resumes
        (`Fleet.check_finished`'s `reset`); "" where none did."""
        left = self.unrestored if left is None else left
        if not left:
            return ""
        by_command: dict[str, list[str]] = {}
        for host in left:
            by_command.setdefault(self.reset_on(host), []).append(host)
        run = ", ".join(f"{command} on {', '.join(hosts)}" for command, hosts in by_command.items())
        # A node whose restore NVML refused for want of root: its GPUs answer, and its reset
        # needs root ("once the GPUs answer again" told to wait for nothing, root unsaid).
        root, every = self._for_root(left)
        # A node whose restore stopped on a bug in dvfs: its GPUs answer (not "once they
        # answer again"), and the bug is said, as the local fleet's line says it.
        from dvfs.errors import GpuPermissionError
        from dvfs.gpu.knobs import RestoreBugError

        bugs = [str(e) for e in self.close_errors if isinstance(e, RestoreBugError)]
        buggy = [h for h, gpus in left.items() if any(g in e for g in gpus for e in bugs)]
        if buggy:
            told = bugs + [str(e) for e in self.close_errors if isinstance(e, GpuPermissionError)]
            answering = all(any(g in e for e in told) for gpus in left.values() for g in gpus)
            why = (
                f"a bug in dvfs stopped the restore on {', '.join(buggy)}, said above: please "
                "report it"
            )
            if root:
                why += f"; for want of root on {', '.join(root)}"
            when = "" if answering else "once the GPUs lost answer again, "
            return (
                f"GPU settings were left unrestored on {', '.join(left)} ({why}): {when}run "
                f"{run}{', as root on ' + ', '.join(root) if root else ''}"
            )
        if every:
            return (
                f"GPU settings were left unrestored on {', '.join(left)} for want of root: "
                f"run {run} as root"
            )
        if root:
            return (
                f"GPU settings were left unrestored on {', '.join(left)} (for want of root on "
                f"{', '.join(root)}): once the GPUs answer again, run {run}, as root on "
                f"{', '.join(root)}"
            )
        # An actor killed inside its `open`: its GPUs never stopped answering, reset now.
        now = {h: g for h, g in left.items() if all(killed_opening(x) for x in g)}
        if now:
            run_now = self._runs(now)
            if len(now) == len(left):
                return (
                    f"GPU settings may be left unrestored on {', '.join(left)} by workers "
                    f"killed as they opened their GPUs: run {run_now} now ({KILLED_OPENING_RESET})"
                )
            rest = self._runs({h: g for h, g in left.items() if h not in now})
            return (
                f"GPU settings were left unrestored on {', '.join(left)}: run {run_now} now "
                f"(workers killed as they opened their GPUs: {KILLED_OPENING_RESET}); once the "
                f"other GPUs answer again, run {rest}"
            )
        return (
            f"GPU settings were left unrestored on {', '.join(left)}: once the GPUs "
            f"answer again, run {run}"
        )

    def _runs(self, left: dict[str, list[str]]) -> str:
        """Each node's `dvfs gpu reset` for the nodes of `left`, those of one command together."""
        by_command: dict[str, list[str]] = {}
        for host in left:
            by_command.setdefault(self.reset_on(host), []).append(host)
        return ", ".join(
            f"{command} on {', '.join(hosts)}" for command, hosts in by_command.items()
        )

    def _lost(self, fleet: Fleet, label: str, cell: Any, exc: BaseException) -> None:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):  # the worker raised: say what, not Ray's wrapper
            why = f"{type(cause).__name__}: {cause}"
            if isinstance(cause, ServerReplacedError) and self.replaced is None:
                self.replaced = cause
            if isinstance(cause, DvfsError) and cause.exit_code != 1 and self.refusal is None:
                self.refusal = cause
        else:
            text = str(exc).strip()
            why = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        record: dict[str, Any] = {"type": "worker_lost", "worker": label, "error": why[:500]}
        if actor_gone(exc) and self._note_died(fleet.campaign, label):
            host = label.split("/", 1)[0]
            record["reset"] = f"run {self.reset_on(host)} on {host}"
            fleet.note(
                f"worker {label} died without restoring its GPUs: run {self.reset_on(host)} on "
                f"{host}"
            )
        fleet.lost(label, cell, bounded_why(why), record)


#: Ray's errors of a call whose actor's process is gone: the actor died (`ray.kill`, a
#: signal), Ray's memory monitor killed it as its node ran low on memory (OutOfMemoryError,
#: not a RayActorError: an ordinary loss on a busy cluster), its node died, its worker crashed,
#: or the unit it returned was lost with its node (an actor's unit is not retried).
#: Not ActorUnavailableError: Ray's word for an actor unreachable for now (restarting, its
#: network), which may answer again: it is closed under the bound like any other, its GPUs
#: named only where its close does not answer.
GONE = (
    "RayActorError",
    "ActorDiedError",
    "OutOfMemoryError",
    "NodeDiedError",
    "WorkerCrashedError",
    "ObjectLostError",
    "ObjectReconstructionFailedError",
)


def actor_gone(exc: BaseException) -> bool:
    """Whether a Ray call failed because its actor's process is gone (killed, by Ray's memory
    monitor too, or with its node). Its exact type: what a worker raised comes back as a
    `RayTaskError(...)` of its own name."""
    return type(exc).__name__ in GONE


def out_of_memory(exc: BaseException) -> bool:
    """Whether Ray's memory monitor killed the actor (its node ran low on memory)."""
    return type(exc).__name__ == "OutOfMemoryError"


def ray_failure(exc: BaseException) -> BaseException | None:
    """Ray's own error in `exc` (a `ray.exceptions.RayError` other than a worker's: its object
    store full, a cancelled task, a timeout, its system error), as raised or as the actor's
    method answered it (inside Ray's `RayTaskError`); None where `exc` is not Ray's (a worker's
    own error: a dvfs line, or a bug)."""
    cause = getattr(exc, "cause", None)
    if _named(exc, "RayTaskError"):
        return cause if isinstance(cause, BaseException) and _named(cause, "RayError") else None
    return exc if _named(exc, "RayError") else None


def _named(exc: BaseException, name: str) -> bool:
    return any(klass.__name__ == name for klass in type(exc).__mro__)


#: Ray's errors of an actor whose process never ran (its worker opened no GPU): its
#: runtime_env could not be set up (dvfs gives none: its Ray job's), or it cannot be placed.
NEVER_STARTED = ("RuntimeEnvSetupError", "ActorUnschedulableError")


def ray_advice(failure: BaseException) -> str:
    """What to do about Ray's own error (`ray_failure`)."""
    if type(failure).__name__ == "RuntimeEnvSetupError":
        return (
            "dvfs sets no runtime_env: fix or drop the one its Ray job was given (`ray job "
            "submit --runtime-env` or --working-dir), then rerun the same command"
        )
    if type(failure).__name__ in ("ObjectStoreFullError", "OutOfDiskError"):
        return (
            "free memory and disk on the cluster's nodes (`ray memory`, `df`), then rerun the "
            "same command"
        )
    return (
        "check the cluster (`ray status`, Ray's logs in /tmp/ray/session_latest/logs on its "
        "nodes), then rerun the same command"
    )
