"""Which twin made a measurement: a digest of the files that decide what the twin reports.

dvfs's own version has stayed "0.1.0" while the twin's physics changed many times, so it cannot
tell two twins apart; the twin's version (`twin_version`, a server record's `version`) and its
GPUs' driver version (`twin_driver_version`, a session record's `driver_version`) carry this
digest instead, and the journal's invariants (`dvfs.records.GPU_INVARIANTS`, `server_changes`,
`arm_changes`) refuse cells of two twins in one journal or cube, as they refuse two drivers.

The twin is every file that turns a campaign's settings into the traces and readings a sweep
measures, so a change to any of them can move a figure:
- the whole `dvfs.twin` package, each module and data file an install ships of it (listed by
  pattern, not named, so a module or profile added later is in the digest unasked): the
  physics, thermal model and NVML traps, the pass counting and draft plans, the acceptance model
  (`textprior`, `drafting`), the profiles and their data (`data/*.toml`: GPUs, models,
  acceptance priors), and the calibration (`fit`, `fitcube`, `predict`), which rewrites profiles
  and reads the physics as the engine does;
- `dvfs.engines.twin` (the engine that runs the passes and draws acceptance) and
  `dvfs.gpu.twin` (what its GPUs report, in NVML's units).
Not the twin: the CLI, plots, analyses and the roofline's twin (`dvfs.roofline.twin`), which
make no sweep's traces; the runner, meter and journal, which measure a real GPU the same way
and are the tool's (its `dvfs_version`); the corpora, which are the workload (the cube records
each corpus's content hash), not the model of the GPU.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from dvfs.version import __version__

#: Hex digits of the digest a version carries: 48 bits, so two twins collide by chance with
#: odds of one in 10^14.
DIGEST_CHARS = 12
#: The data files of `dvfs.twin`, as globs under it: its package data in pyproject.toml (a
#: test holds the two equal), so the digest reads what an install ships.
TWIN_DATA = ("data/*.toml",)
#: Modules outside `dvfs.twin` that belong to the twin (see the module docstring).
TWIN_MODULES = ("dvfs.engines.twin", "dvfs.gpu.twin")
#: Modules named for the twin that are not it, each with why (a test checks that every module
#: named "twin" is in the digest or here).
NOT_TWIN = {
    "dvfs.cli.twin": "the `dvfs twin` commands: they run the twin, they are not it",
    "dvfs.roofline.twin": "the roofline the twin would measure: no sweep's traces",
}
#: What the driver version of a twin GPU starts with (older dvfs wrote it alone).
TWIN_DRIVER = "twin"
#: What a twin server's version starts with (older dvfs wrote "dvfs-twin 0.1.0").
TWIN_ENGINE = "dvfs-twin"


def _dvfs_dir() -> Path:
    """Where this dvfs's package lies (`dvfs/`)."""
    return Path(__file__).resolve().parent.parent


def twin_files(dvfs_dir: Path | None = None) -> list[Path]:
    """Every file of the twin in the `dvfs/` folder `dvfs_dir` (this dvfs's unless given), in a
    fixed order: what an install ships of `twin/` (each module, and its data as `TWIN_DATA`
    globs it), then the `TWIN_MODULES`' sources (found without importing them, which from here
    would be circular). Nothing else in the folder counts: not Python's caches, nor a merge's
    `.orig` or an editor's backup, which a wheel would not carry."""
    root = dvfs_dir or _dvfs_dir()
    package = root / "twin"
    found = {
        path
        for pattern in ("**/*.py", *TWIN_DATA)
        for path in package.glob(pattern)
        if path.is_file() and "__pycache__" not in path.relative_to(package).parts
    }
    modules = [root.joinpath(*name.split(".")[1:]).with_suffix(".py") for name in TWIN_MODULES]
    return sorted(found) + modules


def digest_of(files: Iterable[Path], root: Path) -> str:
    """A short digest of files' names (relative to `root`, so where dvfs is installed does not
    count) and bytes."""
    h = hashlib.sha256()
    for path in files:
        name = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(len(name).to_bytes(8, "little") + name)
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:DIGEST_CHARS]


def twin_digest_of(dvfs_dir: Path) -> str:
    """The digest of the twin in the `dvfs/` folder `dvfs_dir`."""
    return digest_of(twin_files(dvfs_dir), dvfs_dir)


@functools.cache
def twin_digest() -> str:
    """This process's twin's digest (its files read once: about 250 kB, a millisecond)."""
    return twin_digest_of(_dvfs_dir())


def twin_version() -> str:
    """The twin engine's version, as its server records report it ("dvfs-twin 0.1.0+<digest>")."""
    return f"{TWIN_ENGINE} {__version__}+{twin_digest()}"


def twin_driver_version() -> str:
    """A twin GPU's driver version ("twin+<digest>"): cells of two twins compare no more than
    cells of two NVIDIA drivers, and the GPU invariants say so."""
    return f"{TWIN_DRIVER}+{twin_digest()}"


def is_twin_version(version: object) -> bool:
    """Whether a recorded driver or engine version names a twin (this dvfs's form or an
    earlier one's: "twin", "dvfs-twin 0.1.0")."""
    text = str(version or "")
    return any(
        text == mark or text.startswith((f"{mark}+", f"{mark} "))
        for mark in (TWIN_DRIVER, TWIN_ENGINE)
    )


#: What a refusal of cells of two twins adds: why, and what to do.
TWIN_CHANGED = (
    "the twin changed since those cells were measured (its physics, profiles or acceptance "
    "model; a journal whose twin names no +digest is an earlier dvfs's), and cells of two "
    "twins do not compare: rerun with --fresh (or into another --out folder)"
)


def twin_changed(changes: Iterable[str]) -> bool:
    """Whether invariant changes ("driver version: twin+a -> twin+b", "engine version: ...")
    include a twin's version changing into another twin's."""
    for change in changes:
        _, _, values = change.partition(": ")
        before, sep, now = values.partition(" -> ")
        if sep and is_twin_version(before) and is_twin_version(now):
            return True
    return False


def mixed_twins(versions: Mapping[str, object]) -> str | None:
    """Where labelled versions (each cube's engine or driver version) name two twins: the first
    pair that differs ("A: twin+a, B: twin+b"); None when they name one twin, or no twin."""
    twins = [(label, str(v)) for label, v in versions.items() if is_twin_version(v)]
    for label, version in twins[1:]:
        if version != twins[0][1]:
            return f"{twins[0][0]}: {twins[0][1]}, {label}: {version}"
    return None
