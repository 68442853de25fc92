"""Crash safety for GPU settings: a state file per changed GPU, and a lock per GPU.

Before dvfs changes a GPU it writes the GPU's original settings to `<state dir>/<uuid>.json`
(fsynced); after restoring it deletes the file. A file that survives means a run died
(SIGKILL, power loss) with the GPU changed: `dvfs sweep` then refuses the GPU and
`dvfs gpu reset` puts the recorded settings back. A lock file per GPU, held with flock for
the whole run, keeps two dvfs processes from fighting over one GPU.

State lives in /var/lib/dvfs when running as root, else $XDG_STATE_HOME/dvfs
(~/.local/state/dvfs); $DVFS_STATE_DIR overrides both, and must be absolute (a relative one
named another folder from each folder dvfs ran in; a relative $XDG_STATE_HOME is ignored, as
the XDG spec says). Read-only looks at the caps in force
without root read root's records in /var/lib/dvfs (`records_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import platform
import shlex
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from dvfs.errors import (
    DvfsError,
    GpuBusyError,
    GpuError,
    GpuLockFileError,
    GpuStateError,
    StateFolderError,
)
from dvfs.gpu.base import Gpu
from dvfs.gpu.knobs import (
    REFUSED,
    GatheredFailures,
    GpuSettings,
    RestoreBugError,
    bug_as_failure,
    restore_guarded,
    restore_thread,
    side_by_side,
)

ROOT_STATE_DIR = Path("/var/lib/dvfs")
#: The kernel's id of this boot (Linux): dvfs's records carry it (the caps record's entries, a
#: governor's lock record, a state file), since a reboot resets every GPU's clock locks and
#: power limits while the records, under /var/lib, stay.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot's id; None where the kernel does not say (then no entry counts as stale)."""
    try:
        return BOOT_ID.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


#: Where the kernel says when this boot began (`btime`, seconds since the epoch).
KERNEL_STAT = Path("/proc/stat")


def boot_started() -> float | None:
    """When this boot began (seconds since the epoch); None where the kernel does not say."""
    try:
        for line in KERNEL_STAT.read_text(encoding="ascii").splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        pass
    return None


#: How long before this boot began a record without a boot id must have been written to count
#: as an earlier boot's (`before_this_boot`): the clock may be stepped after boot (NTP
#: correcting the RTC), which moves the boot's start as read now, not the stamps written before.
BOOT_CLOCK_MARGIN_S = 600.0


def before_this_boot(boot: Any, stamp: Any) -> bool:
    """Whether a record (a caps record's entry, a governor's lock record, a state file) was
    written during an earlier boot, whose reboot has reset the GPU: its boot id is another
    boot's; or, where it carries none (a dvfs older than the boot id wrote it), its time
    stamp (ISO 8601 with its offset) is before this boot began, by more than a clock step
    (`BOOT_CLOCK_MARGIN_S`). False where neither tells."""
    if boot is not None:
        now = boot_id()
        return now is not None and boot != now
    if not isinstance(stamp, str):
        return False
    started = boot_started()
    try:
        written = datetime.fromisoformat(stamp)
    except ValueError:
        return False
    if started is None or written.tzinfo is None:
        return False
    return written.timestamp() < started - BOOT_CLOCK_MARGIN_S


def default_state_dir() -> Path:
    override = os.environ.get("DVFS_STATE_DIR")
    if override:
        return _folder_from_env("DVFS_STATE_DIR", override, Path(override))
    if os.geteuid() == 0:
        return ROOT_STATE_DIR
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and Path(xdg).is_absolute():  # a relative one is ignored, as the XDG spec says
        return _folder_from_env("XDG_STATE_HOME", xdg, Path(xdg) / "dvfs")
    return Path.home() / ".local" / "state" / "dvfs"


def reset_command(directory: Path) -> str:
    """The `dvfs gpu reset` that restores from the state files in `directory` (`state_dir_flag`)."""
    return f"`dvfs gpu reset{state_dir_flag(directory)}`"


def state_dir_flag(directory: Path) -> str:
    """The ` --state-dir DIR` a command advised to the user (a `dvfs gpu reset`, a `dvfs cap
    reset`) needs to read the state files in `directory`, "" where a plain command reads
    them: where that is not the default (a command run with --state-dir), which a plain
    command does not look in, and where $DVFS_STATE_DIR chose it: such a command is run as
    root, and `sudo` drops the environment (env_reset), so the command it runs looks in
    /var/lib/dvfs. The folder is named absolute: the command may be run from another folder."""
    flag = f" --state-dir {shlex.quote(str(directory.absolute()))}"
    if os.environ.get("DVFS_STATE_DIR"):
        return flag
    try:
        default = directory == default_state_dir()
    except DvfsError:  # the default unusable: the folder named is the one to use
        default = False
    return "" if default else flag


def state_dir_command(command: str, directory: Path) -> str:
    """`command` (one that reads dvfs's state folder: `dvfs gpu reset`, `dvfs cap reset`) with
    the --state-dir it needs to read `directory` (`state_dir_flag`)."""
    return f"{command}{state_dir_flag(directory)}"


def _folder_from_env(variable: str, value: str, path: Path) -> Path:
    """`path`, refused in one line naming the variable when a file (or a device such as
    /dev/null) stands where it or a folder above it should be: the fix is the variable, not
    removing that file; and a relative path, which names another folder from each folder dvfs
    runs in, so that `dvfs gpu reset` and the systemd units would miss the state a run left."""
    if not path.is_absolute():
        tilde = " (a shell expands '~' only unquoted at a word's start: write $HOME)"
        raise DvfsError(
            f"{variable}={value!r} is a relative path, another folder from each folder dvfs "
            f"runs in{tilde if value.startswith('~') else ''}: set {variable} to an absolute "
            "folder, or unset it"
        )
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise DvfsError(
            f"{variable}={value!r} is not a folder dvfs can use for its state ({probe} is not "
            f"a folder): set {variable} to a folder, or unset it"
        )
    return path


def records_dir() -> Path:
    """The state directory a read-only look at the GPUs (`cap show`, `dvfs monitor`) reads
    dvfs's records from: the default one, except for a user other than root (without
    $DVFS_STATE_DIR) whose own holds no caps record, since applying caps needs root: then
    /var/lib/dvfs, where root's `cap apply`, `dvfs govern` and the systemd units keep them."""
    default = default_state_dir()
    if os.environ.get("DVFS_STATE_DIR") or os.geteuid() == 0 or not ROOT_STATE_DIR.is_dir():
        return default
    own = (default / "caps-applied.json").exists() or any(default.glob("governed-GPU-*.json"))
    return default if own else ROOT_STATE_DIR


def ensure_dir(path: Path) -> Path:
    """The state directory, created readable by all (the systemd unit and users read it:
    `cap show`, `monitor` and the dry runs without root), whatever the umask: `mkdir`'s mode
    is masked by it, so a root whose umask is 027 or 077 (a hardened host's) made it 0750 or
    0700, and every user's `dvfs cap show` failed 'permission denied'. So are the folders
    above it that it makes (`$DVFS_STATE_DIR=/srv/dvfs/state`: mkdir's parents take the umask's
    mode, not `mode`, and one of 0750 kept every user out of the state folder within). A
    folder that exists keeps the mode it has."""
    if not path.is_dir():
        made = []  # the folders missing, the state folder and those above it
        probe = path
        while not os.path.lexists(probe) and probe != probe.parent:
            made.append(probe)
            probe = probe.parent
        path.mkdir(parents=True, exist_ok=True, mode=0o755)
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # another user's, made meanwhile: theirs to set
                os.chmod(folder, 0o755)
    return path


def write_json_atomic(path: Path, data: dict[str, Any], mode: int = 0o644) -> None:
    """Write `path` so that a crash leaves the old file or the new one, never half of either
    (`dvfs.outputs`, synced: a state file must outlive a power loss)."""
    from dvfs.outputs import write_bytes

    write_bytes(path, json.dumps(data, indent=2).encode("utf-8"), mode=mode)


def settings_to_dict(s: GpuSettings) -> dict[str, Any]:
    return {
        "uuid": s.uuid,
        "sm_clock_lock_mhz": list(s.sm_clock_lock_mhz) if s.sm_clock_lock_mhz else None,
        "power_limit_mw": s.power_limit_mw,
    }


def settings_from_dict(d: dict[str, Any]) -> GpuSettings:
    """A state file's settings; ValueError where they are not what dvfs writes (a damaged or
    hand-edited file), which a restore would otherwise give NVML as they are."""

    def positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    lock = d.get("sm_clock_lock_mhz")
    if lock is not None and not (
        isinstance(lock, list)
        and len(lock) == 2
        and all(positive_int(x) for x in lock)
        and lock[0] <= lock[1]
    ):
        raise ValueError(
            f"sm_clock_lock_mhz is {json.dumps(lock)[:40]}, expected two clocks in MHz, low "
            "first, or null"
        )
    power = d["power_limit_mw"]
    if power is not None and not positive_int(power):  # None: a GPU without one (NVML)
        raise ValueError(
            f"power_limit_mw is {json.dumps(power)[:40]}, expected a limit in mW, or null"
        )
    return GpuSettings(d["uuid"], (lock[0], lock[1]) if lock else None, power)


@dataclass(frozen=True)
class PendingRestore:
    """A state file left behind: which GPU, what to restore, and who changed it."""

    path: Path
    original: GpuSettings
    pid: int | None
    host: str
    since: str
    command: str
    boot: str | None = None

    @property
    def before_this_boot(self) -> bool:
        """Written during an earlier boot: the reboot since has reset the GPU (driver
        defaults), so what the file holds is no longer the GPU's to restore."""
        return before_this_boot(self.boot, self.since)

    def describe(self) -> str:
        return (
            f"GPU {self.original.uuid} was changed by dvfs {self.command!r} "
            f"(pid {self.pid} on {self.host}, since {self.since}) and not restored"
        )


#: The most bytes of a state file read: one holds a GPU's settings and who changed them (a few
#: hundred bytes); a larger one is no state file, and reading it whole could take all the memory.
MAX_STATE_BYTES = 1 << 20


def read_record(path: Path) -> str:
    """A state file's text (a GPU's, or the caps and governor records beside them): opened
    without blocking (a FIFO would be waited on for ever) and refused (`OSError`, `ValueError`)
    unless a regular file of at most `MAX_STATE_BYTES`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:  # (a folder: IsADirectoryError)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("no regular file: a FIFO or a device")
        data = f.read(MAX_STATE_BYTES + 1)
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"more than {MAX_STATE_BYTES >> 20} MiB, which no state file holds")
    return data.decode("utf-8")


def load_record(path: Path) -> Any:
    """`read_record`'s JSON; `ValueError` where it is nested too deeply for Python's parser
    (a damaged file: a RecursionError was an internal error), as where it is no JSON."""
    from dvfs.inputs import TOO_DEEP

    text = read_record(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{TOO_DEEP} (a damaged file?)") from None


def record_problem(exc: Exception) -> str:
    """Why `read_record` (or the JSON in it) failed, in words: an `OSError`'s reason alone."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


#: `FS_IOC_GETFLAGS` (Linux, `_IOR('f', 1, long)`) and the inode flags that refuse a write
#: even to root: immutable (`chattr +i`), and append-only (`chattr +a`) for a file rewritten.
_GETFLAGS = 0x80086601
_IMMUTABLE_FL, _APPEND_FL = 0x10, 0x20


def _inode_flags(path: Path) -> int:
    """`path`'s inode flags (`lsattr`), 0 where they cannot be read (not there, another file
    system's, no such call): a write then says what is wrong itself."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        buf = fcntl.ioctl(fd, _GETFLAGS, b"\0" * 8)
    except (OSError, ValueError):
        return 0
    finally:
        os.close(fd)
    return int.from_bytes(buf[:4], "little")


def state_folder_unwritable(directory: Path, files: Sequence[Path] = ()) -> OSError | None:
    """Why a command that writes dvfs's state folder `directory` (`files` in it: a GPU's lock,
    the caps record and its lock) would fail to, found without creating or changing anything,
    for a dry run to refuse as the command would: a read-only file system (EROFS), a full one
    (ENOSPC: no block or inode free, root's reserve included), an immutable folder or file
    (EPERM: `chattr +i`, which refuses root too). None where none is seen; permissions are not
    judged (the dry run needs no root, the command it previews runs as root), nor a folder
    that cannot be reached (its readers say so)."""
    probe = directory
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent  # a folder the command makes: where it would make it
    if not probe.is_dir():
        return None
    try:
        fs = os.statvfs(probe)
    except OSError:
        return None
    code, where = 0, directory
    if fs.f_flag & os.ST_RDONLY:
        code = errno.EROFS
    elif (fs.f_blocks and not fs.f_bfree) or (fs.f_files and not fs.f_ffree):
        code = errno.ENOSPC
    elif _inode_flags(probe) & _IMMUTABLE_FL:
        code, where = errno.EPERM, probe
    else:
        refused = [f for f in files if _inode_flags(f) & (_IMMUTABLE_FL | _APPEND_FL)]
        if refused:
            code, where = errno.EPERM, refused[0]
    return OSError(code, os.strerror(code), str(where)) if code else None


def state_folder_problem(directory: Path) -> str | None:
    """Why the state folder `directory` cannot be reached (a file where a folder of its path
    should be, a link in a loop), in one line saying what to do, or None (it is there, or
    missing: nothing recorded yet). For a record in it that cannot be opened: the folder is at
    fault then, not the record, which removing would not help (there is none to remove); and
    `StateStore.readable`'s refusal, in the same words."""
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = record_problem(exc)
    else:
        if stat.S_ISDIR(mode):
            return None
        why = os.strerror(errno.ENOTDIR)  # a device (/dev/null), a FIFO: no folder
    return (
        f"state folder {directory} is unreadable ({why}), so dvfs's records in it cannot be "
        "read: check its path (a link in a loop, a file where a folder should be), or name a "
        "folder with --state-dir"
    )


class StateStore:
    """Per-GPU records of original settings (implements `dvfs.gpu.knobs.ChangeLog`)."""

    def __init__(self, directory: Path | None = None, *, command: str = "sweep") -> None:
        self.directory = directory or default_state_dir()
        self.command = command

    def path(self, uuid: str) -> Path:
        return self.directory / f"{uuid}.json"

    def reset_command(self) -> str:
        """The `dvfs gpu reset` that reads these state files (`reset_command`)."""
        return reset_command(self.directory)

    def record(self, original: GpuSettings) -> None:
        """Write the original settings before the first change; never overwrite an original."""
        path = self.path(original.uuid)
        if path.exists():
            return
        ensure_dir(self.directory)
        write_json_atomic(
            path,
            {
                "original": settings_to_dict(original),
                "pid": os.getpid(),
                "host": platform.node(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": self.command,
                "boot": boot_id(),
            },
        )

    def clear(self, uuid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(uuid).unlink()

    def readable(self) -> bool:
        """Whether the state folder is there (False: none yet, nothing recorded); one that
        cannot be reached (a link in a loop, a file in its path: `exists()` is False for
        them) is no missing folder, whose state files would be taken for none: refused."""
        problem = state_folder_problem(self.directory)
        if problem is not None:
            raise StateFolderError(problem)  # exit 1: no GPU's changes, no other dvfs
        return os.path.isdir(self.directory)

    def left_by_this_process(self) -> list[str]:
        """The GPUs (UUIDs) this process changed and did not put back: their state files are
        still here, for the `dvfs gpu reset` an interrupted command names."""
        return [p.original.uuid for p in self.pending() if p.pid == os.getpid()]

    def pending(self, uuid: str | None = None) -> list[PendingRestore]:
        if not self.readable():
            return []
        files = [self.path(uuid)] if uuid else sorted(self.directory.glob("GPU-*.json"))
        found = []
        for path in files:
            try:  # (a link in a loop is no missing file: it is read, and refused)
                data = load_record(path)
                if not isinstance(data, dict) or not isinstance(data.get("original"), dict):
                    raise ValueError("not a JSON object with an 'original' table")
                original = settings_from_dict(data["original"])
            except FileNotFoundError:  # none (a link to no file: none either)
                continue
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise GpuStateError(
                    f"state file {path} is unreadable ({record_problem(exc)}); inspect and remove "
                    "it by hand after checking the GPU's settings"
                ) from exc
            found.append(
                PendingRestore(
                    path,
                    original,
                    data.get("pid"),
                    data.get("host", "?"),
                    data.get("since", "?"),
                    data.get("command", "?"),
                    boot if isinstance(boot := data.get("boot"), str) else None,
                )
            )
        return found

    def refuse_if_pending(self, gpus: Sequence[Gpu], *, drop_rebooted: bool = True) -> None:
        """Stop before touching GPUs that still hold an earlier run's changes. A file written
        before the last reboot holds none (the reboot reset the GPU, and `restore_pending`
        would only drop it): it refuses nothing, and is dropped here, where the caller holds
        the GPU's lock, so that the run's own file takes its place (with `drop_rebooted`
        False, for a look that changes nothing, it is only passed over)."""
        problems = []
        for gpu in gpus:
            for pending in self.pending(gpu.identity.uuid):
                if not pending.before_this_boot:
                    problems.append(pending)
                elif drop_rebooted:
                    self.clear(gpu.identity.uuid)
        if problems:
            raise GpuStateError(
                "; ".join(p.describe() for p in problems)
                + f". Run {reset_command(self.directory)} (as root) to restore the recorded "
                "settings first."
            )


class GpuLocks:
    """Exclusive flock per GPU for the life of the block; refuses a GPU another dvfs holds."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_state_dir()

    @contextlib.contextmanager
    def hold(self, gpus: Sequence[Gpu]) -> Iterator[None]:
        ensure_dir(self.directory)
        handles = []
        try:
            for gpu in gpus:
                path = self.directory / f"{gpu.identity.uuid}.lock"
                planted = users_lock_link(path)
                if planted is not None:  # as root, never opened (made 0644, cut) through it
                    raise GpuLockFileError(planted)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
                except IsADirectoryError:  # a folder, or a link to a folder's name ("x/")
                    raise GpuLockFileError(broken_lock_link(path) or _not_a_lock(path)) from None
                except OSError:  # a link to no file, or in a loop: named, not "no such file"
                    broken = broken_lock_link(path)
                    if broken is None:
                        raise
                    raise GpuLockFileError(broken) from None
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise GpuLockFileError(_not_a_lock(path))
                # readable by all whatever the umask: the dry runs and `doctor` run without
                # root tell a GPU another dvfs holds by it (`holder`), an unreadable one as free
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError as exc:
                    owner = _lock_owner(fd)
                    os.close(fd)
                    raise GpuBusyError(_busy(gpu, owner), owner) from exc
                handles.append(fd)
                try:
                    os.ftruncate(fd, 0)
                    os.write(fd, str(os.getpid()).encode())
                except OSError as exc:  # a full disk: the lock file named, not the --out folder
                    raise OSError(exc.errno, exc.strerror, str(path)) from exc
            yield
        finally:
            for fd in handles:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def not_a_lock(self, gpu: Gpu) -> str | None:
        """What is wrong with `gpu`'s lock file where it is no regular file (a folder, a FIFO),
        which no running dvfs holds (`hold` refuses it), or None; opens nothing."""
        path = self.directory / f"{gpu.identity.uuid}.lock"
        planted = users_lock_link(path)  # as root, `hold` refuses it
        if planted is not None:
            return planted
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError:  # none (never held here) or not to be looked at: hold() will say,
            return broken_lock_link(path)  # as it says a link to no file or in a loop
        return None if regular else _not_a_lock(path)

    def holder(self, gpu: Gpu) -> str | None:
        """Why `hold` would refuse `gpu` now (another dvfs holds its lock), or None; creates
        and changes nothing (a shared lock tried and let go at once), for `dvfs doctor`."""
        path = self.directory / f"{gpu.identity.uuid}.lock"
        planted = users_lock_link(path)  # as root, `hold` refuses it: no dvfs holds it there
        if planted is not None:
            return planted
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: not waited on
        except OSError:  # no lock file (never held here) or unreadable: hold() will say;
            return broken_lock_link(path)  # a link to no file or in a loop, hold() refuses
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return _not_a_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _busy(gpu, _lock_owner(fd))
        finally:
            os.close(fd)  # lets go of the shared lock where it was taken
        return None


def root_holder(gpu: Gpu, directory: Path) -> str | None:
    """Why a run keeping its GPU locks in `directory`, not root's /var/lib/dvfs (a user's
    observe-only sweep, in the user's own state folder), must leave `gpu` alone: root's dvfs
    (a sweep, a governor) holds it there and may step its clocks and power limit, which the
    run would measure as its stock. None where it does not; reads the lock (as `holder`),
    creates and changes nothing there."""
    if directory == ROOT_STATE_DIR:
        return None
    root = GpuLocks(ROOT_STATE_DIR)
    if root.not_a_lock(gpu) is not None:
        return None  # no running dvfs holds a lock that is no file: root's `hold` refuses it
    busy = root.holder(gpu)
    if busy is None:
        return None
    return (
        f"{busy} (its lock is in {ROOT_STATE_DIR}: a dvfs run as root, which may change the "
        "GPU's clocks and power limit while this run measures them as stock)"
    )


def refuse_root_held(gpus: Sequence[Gpu], directory: Path) -> None:
    """`GpuBusyError` for the first of `gpus` root's dvfs holds (`root_holder`), as `hold`
    refuses a GPU another dvfs holds in `directory`."""
    for gpu in gpus:
        busy = root_holder(gpu, directory)
        if busy is not None:
            owner = "?"
            lock = ROOT_STATE_DIR / f"{gpu.identity.uuid}.lock"
            # read as `holder` read it for `busy`: 64 bytes at most, bytes not UTF-8 replaced
            # (the whole file was read, and one not UTF-8 was "?" where `busy` named its pid),
            # never waited on (a FIFO put there since)
            with contextlib.suppress(OSError):
                fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    owner = _lock_owner(fd)
                finally:
                    os.close(fd)
            raise GpuBusyError(busy, owner)


def _lock_owner(fd: int) -> str:
    """The pid a GPU lock's holder wrote in it (open as `fd`), as written: its first 64 bytes,
    those not UTF-8 replaced; "?" where it wrote none."""
    return os.read(fd, 64).decode(errors="replace").strip() or "?"


def _not_a_lock(path: Path) -> str:
    return (
        f"{path} is no regular file (a folder, a FIFO, a device), so no GPU lock of dvfs's: "
        "move it aside (out of the state folder), then run the command again"
    )


def users_lock_link(path: Path, what: str = "GPU lock file") -> str | None:
    """As root, what is wrong with the lock file `path` (`what`: a GPU's, or the caps record's)
    where it goes through a symbolic
    link another user may have placed (`dvfs.outputs.check_links`: in a state folder others may
    write, as a shared one of 1777), or None. `hold` opens the lock to write it (made 0644, cut,
    its pid written): through such a link, any root file (/etc/shadow) was made readable by all
    and cut; and through one to a file to be made in that user's folder, they could remove the
    lock root's dvfs held there, so that a second dvfs made another and held the GPU too."""
    from dvfs.errors import OutputRefusedError
    from dvfs.outputs import check_links

    try:
        check_links(
            path,
            "remove the link, as dvfs makes the lock file itself, or keep the state folder one "
            "only root can write",
        )
    except OutputRefusedError as exc:
        return f"{what} {exc}"
    return None


def broken_lock_link(path: Path, what: str = "GPU lock file") -> str | None:
    """What is wrong with the lock file `path` (`what`: a GPU's, or the caps record's) where it
    is a symbolic link to no file (its target removed, or a folder of it), to a folder's name
    that is none ("x.lock/"), or in a loop (`link_loop_problem`), or None. Opening it said "no
    such file or folder" of a link that is there (the state folder exists), "is a directory",
    or "too many levels of symbolic links": no running dvfs holds a lock through any."""
    from dvfs.inputs import link_loop_problem

    if not os.path.islink(path):
        return None
    if link_loop_problem(path) is not None:
        link = "a symbolic link in a loop"
    elif not os.path.exists(path) and not os.path.isdir(os.path.dirname(os.path.realpath(path))):
        # a link to a file not there yet, in a folder that is, is no problem: the lock is
        # made there (O_CREAT), so the dry run and doctor pass it as the apply does
        link = f"a symbolic link to {os.readlink(path)}, in a folder that does not exist"
    elif not os.path.exists(path) and os.readlink(path).endswith("/"):
        # a folder's name: no lock file is made there (the open says "is a directory"), which
        # the dry run and doctor passed as a file to make
        link = f"a symbolic link to {os.readlink(path)}, a folder's name that is no folder"
    else:
        return None
    return (
        f"{what} {path} is {link}, so no lock of dvfs's: remove the link (dvfs makes the lock "
        "file itself), then run the command again"
    )


def _busy(gpu: Gpu, owner: str) -> str:
    return (
        f"GPU {gpu.identity.index} ({gpu.identity.uuid}) is in use by another dvfs process "
        f"(pid {owner}); wait for it to finish or stop it"
    )


#: How long `restore_pending` holds back the line of a GPU put back while a GPU before it is
#: still being put back (to say them in the GPUs' order) before it says it all the same.
HOLD_LINES_S = 1.0


def restore_pending(
    gpus: Sequence[Gpu],
    store: StateStore,
    note: Callable[[str], None] = lambda line: None,
    *,
    hold_s: float = HOLD_LINES_S,
) -> list[str]:
    """Put back the settings recorded in state files for these GPUs; returns what was done,
    and `note` hears each line once done (a failure, raised at the end, loses the list), in
    the GPUs' order (the GPUs are put back side by side and finish in any order): a GPU's line
    is said as soon as it and every GPU before it are done, or, where one before it is still
    in its driver after `hold_s` (hung: a deadline, 10 s, each call), at once: held back for
    that GPU, the lines of the GPUs put back were lost to a unit's SIGKILL at its stop timeout
    (the GPUs back, their state files gone, and nothing said of them).
    A file written before the last reboot is dropped instead: the reboot reset the GPU, and
    putting the earlier boot's settings back (static caps included, whose record that reboot
    voided) would leave the GPU changed where no record says so.

    Failures are gathered and raised together after every GPU was tried: a state file that
    cannot be removed (a folder remounted read-only, a busy file) too, its GPU put back, so
    that the GPUs after it are still put back; and a bug in one GPU's restore
    (`RestoreBugError`), its line naming the other GPUs' failures and the reset to run.
    """
    done: list[str] = []
    failures = GatheredFailures()
    unremoved: list[tuple[Gpu, OSError]] = []

    def clear(gpu: Gpu) -> None:
        try:
            store.clear(gpu.identity.uuid)
        except OSError as exc:  # said once every GPU was tried, not before the next one
            unremoved.append((gpu, exc))

    recorded: dict[str, list[PendingRestore]] = {}
    for gpu in gpus:
        for pending in store.pending(gpu.identity.uuid):
            if pending.before_this_boot:  # the reboot reset the GPU: nothing to put back
                clear(gpu)
                done.append(
                    f"dropped the state file of GPU {gpu.identity.index} ({gpu.identity.uuid}): "
                    f"the reboot since dvfs {pending.command!r} (pid {pending.pid}) changed it "
                    "reset it to driver defaults, nothing to restore"
                )
                note(done[-1])
                continue
            recorded.setdefault(gpu.identity.uuid, []).append(pending)

    def put_back(gpu: Gpu) -> list[GpuError]:
        try:
            for pending in recorded[gpu.identity.uuid]:
                damaged = _outside_gpu(gpu, pending, store)
                if damaged is not None:  # (before any knob is set: the GPU left as it is)
                    return [GpuStateError(damaged)]
                _put_back_recorded(gpu, pending.original)
        except GpuError as exc:
            return [exc]
        return []

    # side by side: GPUs whose driver calls hang cost one deadline in all, not one each (the
    # governor unit's ExecStopPost, under its stop timeout)
    changed = [g for g in gpus if g.identity.uuid in recorded]
    failed: dict[str, list[GpuError]] = {}
    bugs: dict[int, Exception] = {}
    finished: set[str] = set()
    said: set[str] = set()  # the GPUs whose lines are said (or that have none: failed, a bug)

    def say(gpu: Gpu) -> None:
        said.add(gpu.identity.uuid)
        if gpu.identity.uuid in failed or id(gpu) in bugs:
            return
        for pending in recorded[gpu.identity.uuid]:
            done.append(_restored_line(gpu, pending))
            note(done[-1])

    def say_held() -> None:  # a GPU before them still in its driver: said all the same
        for gpu in changed:
            if gpu.identity.uuid in finished and gpu.identity.uuid not in said:
                say(gpu)

    restoring_all = side_by_side(
        changed,
        restore_guarded(put_back, bugs),
        named=restore_thread,
        stalled=say_held,
        stall_s=hold_s,
    )
    with contextlib.closing(restoring_all) as finishing:
        try:
            for gpu, errors in finishing:
                finished.add(gpu.identity.uuid)
                if errors:
                    failed[gpu.identity.uuid] = errors
                elif errors is not None:  # (None: a bug, `bugs`; not known to be back)
                    clear(gpu)  # at once, whatever GPU before it is still being put back
                for first in changed:  # those done, up to the first GPU not done, in order
                    if first.identity.uuid not in finished:
                        break
                    if first.identity.uuid not in said:
                        say(first)
        except BaseException:  # a signal as it waits (the first, under `signals_raise`):
            # the GPUs back, their state files gone, are said before it ends the reset
            say_held()
            raise
    failures.add_per_gpu(
        [
            (g, e)
            for g in changed
            for e in (
                [bug_as_failure(bugs[id(g)], g)]
                if id(g) in bugs
                else failed.get(g.identity.uuid, [])
            )
        ],
        named=False,
    )
    if unremoved:
        failures.messages.append(_unremoved_line(unremoved, store))
    head = "could not restore: "
    if bugs:  # an internal error, still naming every GPU's failure and the reset to run
        first_bug = next(bugs[id(g)] for g in changed if id(g) in bugs)
        tail = bug_advice(store)
        raise RestoreBugError(head + "; ".join(failures.messages) + tail) from first_bug
    if unremoved and len(failures.messages) == 1:
        raise StateFolderError(failures.messages[0]) from unremoved[0][1]
    failures.raise_if_any(head)
    return done


def bug_advice(store: StateStore) -> str:
    """The end of `restore_pending`'s `RestoreBugError` line: the reset that retries (kept at
    the end of the line where more failures join it: `dvfs.caps.reset_gpus`)."""
    return f". The GPUs not restored keep their state files: {store.reset_command()} retries"


def _unremoved_line(unremoved: Sequence[tuple[Gpu, OSError]], store: StateStore) -> str:
    """What `restore_pending` says of the state files it could not remove, their GPUs put back
    (or their files from before the last reboot) all the same."""
    which = ", ".join(f"GPU {g.identity.index} ({g.identity.uuid})" for g, _ in unremoved)
    whys = sorted({f"{record_problem(exc)}" for _, exc in unremoved})
    return (
        f"cannot remove the state file of {which} in {store.directory} ({'; '.join(whys)}), "
        "though nothing it records is left to restore: while it stays, sweeps and `dvfs cap "
        "apply` refuse the GPU; once the folder can be written (a read-only mount, a file in "
        f"use), run {store.reset_command()} again, or remove the file"
    )


def _restored_line(gpu: Gpu, pending: PendingRestore) -> str:
    """What `restore_pending` says of a GPU put back as `pending` recorded."""
    original, limit = pending.original, pending.original.power_limit_mw
    lock = (
        f"clocks locked to {original.sm_clock_lock_mhz[0]}-{original.sm_clock_lock_mhz[1]} MHz"
        if original.sm_clock_lock_mhz
        else "clocks unlocked"
    )
    power = (
        f"power limit {limit / 1000:g} W"
        if limit is not None
        else "power limit not supported, left be"
    )
    return (
        f"restored GPU {gpu.identity.index} ({gpu.identity.uuid}): {lock}, {power} "
        f"(as before {pending.command!r} pid {pending.pid})"
    )


def _outside_gpu(gpu: Gpu, pending: PendingRestore, store: StateStore) -> str | None:
    """Why a state file's recorded settings are none this GPU had (a hand edit: a power limit
    outside its range, a clock lock outside its SM clocks), so damaged: restored, they
    were set blindly, a knob changed before NVML refused the other, the file named nowhere.
    None where both are this GPU's to set."""
    original, index = pending.original, gpu.identity.index
    problem = None
    limit = original.power_limit_mw
    if limit is not None:
        try:
            limits = gpu.power_limit_range()
        except REFUSED:  # (no range to tell by: the restore's own call says what NVML does)
            limits = None
        if limits is not None and limits.outside(limit) is not None:
            problem = f"power_limit_mw is {limit}, outside this GPU's range {limits.describe_w()}"
    lock = original.sm_clock_lock_mhz
    if problem is None and lock is not None:
        supported = gpu.supported_sm_clocks_mhz()  # (NVML takes any clock within the range)
        if lock[0] < min(supported) or lock[1] > max(supported):
            problem = (
                f"sm_clock_lock_mhz is [{lock[0]}, {lock[1]}], outside this GPU's SM clocks "
                f"{min(supported)}-{max(supported)} MHz"
            )
    if problem is None:
        return None
    defaults = state_dir_command(f"dvfs gpu reset {index} --defaults", store.directory)
    return (
        f"GPU {index} ({gpu.identity.uuid}) was left as it is: its state file {pending.path} is "
        f"damaged ({problem}: no setting dvfs read from it, a hand edit?); check the GPU's "
        f"settings and remove the file by hand, then `{defaults}` puts back its driver defaults"
    )


def _put_back_recorded(gpu: Gpu, original: GpuSettings) -> None:
    """Put back what a state file recorded for `gpu`: its clock lock (or none) and its power
    limit, which goes back even where NVML refused the clock's (that changed nothing)."""
    refused: GpuError | None = None
    try:
        if original.sm_clock_lock_mhz:
            gpu.lock_sm_clock(*original.sm_clock_lock_mhz)
        else:
            gpu.reset_sm_clock()
    except REFUSED as exc:  # changed nothing: the power limit goes back still
        refused = exc
    limit = original.power_limit_mw  # None: not supported, so never changed
    if limit is not None and gpu.power_limit_mw() != limit:
        gpu.set_power_limit_mw(limit)
    if refused is not None:
        raise refused
