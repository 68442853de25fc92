"""One error tree, so the CLI can turn every failure into a message that says what to do."""

from __future__ import annotations

#: The most characters of an error line (`dvfs.cli.common.one_line` cuts it there).
MAX_MESSAGE_CHARS = 1000


class DvfsError(Exception):
    """Base of every error dvfs raises on purpose; the message is meant for the user."""

    exit_code = 1


class CampaignError(DvfsError):
    """A campaign file is malformed: the message names the key, the value and what is allowed."""

    exit_code = 2


class NetcdfPathError(DvfsError):
    """A path netCDF-C cannot use: it reads a backslash in it as '/' (`dvfs.outputs`)."""


class OutputRefusedError(DvfsError):
    """As root, an output path through a symbolic link another user may point anywhere
    (`dvfs.outputs.check_links`), a link to a file in a folder that does not exist
    (`dvfs.outputs.check_link_target`), or a named pipe no program read from in 30 s: refused
    as bad usage, before anything is written."""

    exit_code = 2


class JournalError(DvfsError):
    """The journal cannot be used (another campaign's, or corrupt beyond its last line)."""


class CubeError(DvfsError):
    """A cube is missing, of an unknown schema, or does not have the shape an analysis needs."""


class NoJournalError(CubeError):
    """A sweep folder's journal is missing, or is a path that cannot be opened (a symbolic link
    in a loop or to nothing): nothing of the sweep's is in it to fix."""


class MergeRefusedError(CubeError):
    """The cubes given to merge are readable but do not form one merge (other campaigns, the
    same GPU twice, a shard missing...): refused as invalid input, as a bad campaign is."""

    exit_code = 2


class IncomparableCellsError(CubeError):
    """The journal holds cells that cannot share a cube (GPUs, engines or arms that differ):
    nothing done to its folder afterwards makes them one, so the message says where to rerun."""


class GpuError(DvfsError):
    """A GPU operation failed. `index`: the NVML index of the GPU that would not open, where a
    command opening every GPU on its own knows it (`dvfs.backends.reachable_gpus`: for one
    named by UUID, where its UUID or NVML's list of UUIDs tells); `uuid`: the UUID it was named
    by where it was named so."""

    index: int | None = None
    uuid: str | None = None


class GpuUnavailableError(GpuError):
    """No driver or no such device: use the twin backend or install the NVIDIA driver."""


class GpuNotFoundError(GpuUnavailableError):
    """No GPU of that index or UUID on this machine (a typo, not a GPU that fails NVML): bad
    usage, exit 2, so that a systemd unit naming it (`RestartPreventExitStatus=2`) is left
    failed rather than restarted on an error no restart fixes."""

    exit_code = 2


class GpuPermissionError(GpuError):
    """A setter needs root: run as root or through the systemd unit."""

    exit_code = 4


class GpuNotSupportedError(GpuError):
    """The device does not support the call (MIG slices, old GPUs, unsupported clocks)."""


class GpuMigError(GpuNotSupportedError):
    """A GPU with MIG enabled, which dvfs refuses (it meters and caps whole GPUs): a setting of
    the host, not a failure a restart fixes, so exit 2, as a GPU not here, and a systemd unit
    naming it (`RestartPreventExitStatus=2`) is left failed rather than restarted."""

    exit_code = 2


class GpuValueError(GpuError):
    """A value outside what the device accepts; the message gives the allowed range."""


class GpuStateError(GpuError):
    """The GPU holds changes dvfs made and has not restored, or another dvfs process owns it."""

    exit_code = 3


class StateFolderError(GpuStateError):
    """dvfs's state folder cannot be reached (a file where a folder of its path goes, a link in
    a loop, a device): the folder's fault, exit 1 as `cap show` and `monitor` say it, not 3
    (no GPU holds changes, no other dvfs uses it). A `GpuStateError` still to the callers that
    name a state file they cannot read (`dvfs doctor`'s state check)."""

    exit_code = 1


class GpuLockFileError(GpuError):
    """A GPU's lock file in the state folder is no regular file (a folder, a FIFO): no running
    dvfs holds it, so exit 1 (a state folder's fault), not 3 (another dvfs uses the GPU)."""


class GpuBusyError(GpuStateError):
    """Another dvfs process holds the GPU's lock (`pid`, as it wrote it: "?" if unreadable)."""

    def __init__(self, message: str, pid: str) -> None:
        super().__init__(message)
        self.pid = pid

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Both arguments, so that it pickles (a Ray actor's error reaches the driver so)
        return (type(self), (str(self), self.pid))


class EngineError(DvfsError):
    """The serving engine failed to start, answer, or finish a workload."""


class ServerRefusedError(EngineError):
    """A server that started but was refused, since its cells would not compare with the
    journal's (another SGLang, or other flags): `fix` says what would make them compare, which
    a rerun alone does not."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (str(self), self.fix))


class ServerUnfitError(EngineError):
    """SGLang would not start the server for the campaign as it is (weights too large for
    its GPUs, a --context-length above the model's: on the twin, or as a real server's output
    said as it exited, `dvfs.engines.sglang_refusals`): a rerun fails it again, so the campaign
    must change (what its message ends with, after its last ": "), and a changed campaign
    cannot resume the journal."""


#: What a failed cell's error says ahead of why SGLang would not start its drafter's server for
#: the campaign as it is (`ServerUnfitError`): a rerun fails it again, the campaign must change
#: (a fleet's driver, `dvfs cube info` and the headroom read it off the record).
START_UNFIT = "server start failed (SGLang would not start it for this campaign): "


def unfit_fix(error: str) -> str | None:
    """What a failed cell's `error` says to change in the campaign where SGLang would not start
    its server for it as it is (`START_UNFIT`: the refusal's last clause); None for any other
    error (a rerun may retry it)."""
    if not error.startswith(START_UNFIT):
        return None
    return error.rpartition(": ")[2]


#: How many failed cells a cube's `failed_cells` attribute lists (a sweep's or a merge's).
FAILED_CELLS_CAP = 200


def capped_failed(records: list[dict[str, object]]) -> list[dict[str, object]]:
    """A cube's `failed_cells` records, the first `FAILED_CELLS_CAP` of them, and besides them
    the first record of each drafter (on each GPU, where `gpu` is said) whose cells failed as
    SGLang would not start its server (`unfit_fix`): `dvfs cube info` tells those cells apart
    from the ones a rerun retries by these records, and would count them among the others."""
    kept = records[:FAILED_CELLS_CAP]
    seen = {_unfit_key(r) for r in kept}
    for record in records[FAILED_CELLS_CAP:]:
        key = _unfit_key(record)
        if key is not None and key not in seen:
            seen.add(key)
            kept.append(record)
    return kept


def _unfit_key(record: dict[str, object]) -> tuple[str, str] | None:
    """(drafter, GPU label) of a failed cell's record SGLang would not start the server of."""
    cell = record.get("cell")
    if not isinstance(cell, dict) or unfit_fix(str(record.get("error") or "")) is None:
        return None
    return str(cell.get("drafter")), str(record.get("gpu") or "")


class EngineCrashedError(EngineError):
    """The server process died: the cell may be retried after a restart."""


class EngineHungError(EngineCrashedError):
    """The server was alive but stopped answering, and dvfs stopped it: retried after a
    restart as a dead one is, but said as what it is."""


class ServerReplacedError(DvfsError):
    """The SGLang server dvfs attached to (engine.sglang.url) answers as another one (other
    args, another SGLang): every later cell would be measured on it and refused alike, so the
    sweep stops, its journal as it was (not an `EngineError`, which fails one cell)."""


class ArmMismatchError(EngineError):
    """SGLang would set a scheduling argument differently for some of the campaign's drafters
    whatever dvfs passes, so its arms would differ in more than their drafters: an invalid
    campaign, refused before any server starts, so a usage error."""

    exit_code = 2


class CorpusError(DvfsError):
    """A corpus cannot be loaded or sampled; the message names the file and line. The input
    is at fault (a file missing, damaged or unreadable, as a campaign file would be; a table
    that names no usable data): an invalid campaign, exit 2, as `sweep`, its dry run and
    `doctor` all say."""

    exit_code = 2


class CorpusUnavailableError(CorpusError):
    """This environment cannot load a corpus that may be fine: too little memory, a missing
    library or package, an unreachable hub. An error, not an invalid campaign (exit 1)."""

    exit_code = 1


class CorpusShortfallError(CorpusError):
    """The campaign asks more of its corpora than they hold (a batch larger than the prompts
    in its input range): an invalid campaign, as its dry run says, so a usage error."""

    exit_code = 2


class PromptTooLongError(CorpusError):
    """A corpus holds prompts that, with the output asked, exceed the twin model's context
    length, which SGLang refuses: an invalid campaign, refused before it runs (exit 2)."""

    exit_code = 2


class AnalysisError(DvfsError):
    """An analysis was asked something the cube cannot answer."""


class CapsError(DvfsError):
    """A caps file is malformed or unsafe."""

    exit_code = 2


class CapsRecordError(CapsError):
    """dvfs's own caps or governor record (in its state directory) is unreadable or damaged: a
    failure, exit 1, not bad usage (2), which the units do not restart on. Removing it mends it
    (then `cap apply` again for the caps record, which it refuses as it is); a governor
    starting on a GPU replaces that GPU's record."""

    exit_code = 1
