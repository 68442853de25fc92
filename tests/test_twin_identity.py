"""The twin's identity: a digest of its files, carried in its server's version and its GPUs'
driver version, so that a journal begun by one twin is refused by another (at resume, before
anything is measured, and at cube build) and resumed by the same one."""

from __future__ import annotations

import importlib
import json
import pkgutil
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import REPO, TINY, copy_sweep, write
from test_journal import assert_one_line_error
from test_resume import _interrupt_after

import dvfs
from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube
from dvfs.measure.journal import read_records
from dvfs.twin import identity
from dvfs.twin.identity import (
    NOT_TWIN,
    TWIN_MODULES,
    twin_changed,
    twin_digest_of,
    twin_driver_version,
    twin_files,
    twin_version,
)

OTHER_DIGEST = "0123456789ab"
#: What every refusal of another twin's journal says (`identity.TWIN_CHANGED`).
TWIN_ADVICE = ("the twin changed", "--fresh", "--out")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def sweep(campaign: Path, out: Path, *extra: str) -> Result:
    return invoke("sweep", str(campaign), "--out", str(out), "--no-progress", *extra)


# -- which files are the twin ------------------------------------------------------------------
def _twin_copy(tmp_path: Path) -> Path:
    """The twin's files copied into TMP/dvfs, as `twin_files` finds them."""
    root = tmp_path / "dvfs"
    source = Path(dvfs.__file__).resolve().parent
    for path in twin_files():
        target = root / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return root


def test_the_digest_covers_every_file_of_the_twin_package() -> None:
    package = REPO / "dvfs" / "twin"
    kinds = {".py", ".toml", ".json", ".jsonl", ".csv", ".yaml", ".npz"}  # code or data
    on_disk = {p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    on_disk = {p for p in on_disk if p.suffix in kinds}
    files = twin_files()
    assert on_disk <= set(files)
    assert {p.name for p in on_disk} >= {"physics.py", "gpus.toml", "acceptance.toml"}
    for name in TWIN_MODULES:
        assert Path(importlib.import_module(name).__file__ or "").resolve() in files


def test_the_digest_reads_the_twin_data_an_install_ships() -> None:
    """TWIN_DATA is `dvfs.twin`'s package data: a wheel carries what the digest reads."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = project["tool"]["setuptools"]["package-data"]["dvfs.twin"]
    assert sorted(shipped) == sorted(identity.TWIN_DATA)


def test_every_module_named_for_the_twin_is_in_the_digest_or_says_why_not() -> None:
    """A twin module added outside `dvfs/twin/` (an engine or GPU helper) is listed or
    excused: every module whose dotted name holds "twin" is either."""
    named = [
        m.name
        for m in pkgutil.walk_packages(dvfs.__path__, "dvfs.")
        if "twin" in m.name and not m.name.startswith("dvfs.twin")
    ]
    assert named, "the walker found no twin module"
    for name in named:
        assert name in TWIN_MODULES or name in NOT_TWIN, f"{name}: in the digest, or in NOT_TWIN"


def test_a_file_added_or_changed_in_the_twin_changes_its_digest(tmp_path: Path) -> None:
    root = _twin_copy(tmp_path)
    before = twin_digest_of(root)
    assert before == identity.twin_digest()  # where dvfs lies does not count
    (root / "twin" / "calibration.py").write_text("SCALE = 1.0\n")  # a module added later
    added = twin_digest_of(root)
    assert added != before
    (root / "twin" / "calibration.py").unlink()
    assert twin_digest_of(root) == before
    # The auditor's change: the H100 profile's HBM bandwidth.
    gpus = root / "twin" / "data" / "gpus.toml"
    text = gpus.read_text()
    assert "hbm_bandwidth_gb_s = 3350" in text
    gpus.write_text(text.replace("hbm_bandwidth_gb_s = 3350", "hbm_bandwidth_gb_s = 2000", 1))
    assert twin_digest_of(root) not in (before, added)
    # The engine, outside the package, counts too; Python's caches do not.
    gpus.write_text(text)
    (root / "twin" / "__pycache__").mkdir()
    (root / "twin" / "__pycache__" / "physics.cpython-311.pyc").write_bytes(b"\0")
    assert twin_digest_of(root) == before
    # Nor what a merge or an editor leaves beside the files, which no install carries.
    for stray in ("physics.py.orig", "physics.py~", "#fit.py#", "data/gpus.toml.bak"):
        (root / "twin" / stray).write_text("x = 1\n")
    assert twin_digest_of(root) == before
    engine = root / "engines" / "twin.py"
    engine.write_text(engine.read_text() + "\n# a comment\n")
    assert twin_digest_of(root) != before


def test_the_versions_carry_the_digest() -> None:
    digest = identity.twin_digest()
    assert len(digest) == identity.DIGEST_CHARS
    assert twin_version() == f"dvfs-twin {dvfs.__version__}+{digest}"
    assert twin_driver_version() == f"twin+{digest}"


@pytest.mark.parametrize(
    ("changes", "twin"),
    [
        (["driver version: twin+aaaaaaaaaaaa -> twin+bbbbbbbbbbbb"], True),
        (["driver version: twin -> twin+bbbbbbbbbbbb"], True),  # an earlier dvfs's journal
        (["engine version: dvfs-twin 0.1.0 -> dvfs-twin 0.1.0+bbbbbbbbbbbb"], True),
        (["driver version: 550.54.15 -> 560.28.03"], False),
        (["engine version: 0.5.9 -> 0.5.23"], False),
        (["GPU model: NVIDIA H100 80GB HBM3 (twin) -> NVIDIA H200 (twin)"], False),
        (["driver version: twin+aaaaaaaaaaaa -> 560.28.03"], False),
    ],
)
def test_twin_changed_reads_the_invariants_changes(changes: list[str], twin: bool) -> None:
    assert twin_changed(changes) is twin


# -- a journal of another twin -----------------------------------------------------------------
@pytest.fixture
def begun(tiny_sweep: Path, tmp_path: Path) -> Path:
    """TINY's sweep cut back to 6 of its 16 cells, as if interrupted: begun by this twin."""
    out = copy_sweep(tiny_sweep, tmp_path / "out")
    (out / "cube.nc").unlink()
    _interrupt_after(out / "journal.jsonl", 6)
    return out


def _another_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's twin as a changed one would be: another digest (as a changed profile
    gives, `test_a_file_added_or_changed_in_the_twin_changes_its_digest`)."""
    monkeypatch.setattr(identity, "twin_digest", lambda: OTHER_DIGEST)


def test_the_same_twin_resumes_its_journal(begun: Path, tmp_path: Path) -> None:
    result = sweep(write(tmp_path / "tiny.toml", TINY), begun)
    assert result.exit_code == 0, result.output
    assert "10 cell(s) measured" in result.output
    records = read_records(begun / "journal.jsonl")
    sessions = [r for r in records if r["type"] == "session"]
    assert len(sessions) == 2
    assert {g["driver_version"] for s in sessions for g in s["gpus"]} == {twin_driver_version()}
    assert {r["version"] for r in records if r["type"] == "server"} == {twin_version()}
    ds = open_cube(begun / "cube.nc")
    assert (ds["cell_status"].values == STATUS_OK).all()
    assert ds.attrs["engine_version"] == twin_version()
    assert ds.attrs["driver_version"] == twin_driver_version()
    info = invoke("cube", "info", str(begun / "cube.nc"))
    assert info.exit_code == 0, info.output
    assert twin_version() in info.output and twin_driver_version() in info.output


def test_another_twin_is_refused_at_resume_before_measuring(
    begun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = begun / "journal.jsonl"
    before = journal.read_bytes()
    began = twin_driver_version()
    _another_twin(monkeypatch)
    result = sweep(write(tmp_path / "tiny.toml", TINY), begun)
    assert_one_line_error(
        result, 1, f"driver version: {began} -> twin+{OTHER_DIGEST}", *TWIN_ADVICE
    )
    assert journal.read_bytes() == before  # nothing measured, no session begun
    assert not (begun / "cube.nc").exists()
    # --fresh moves the other twin's journal aside and measures everything anew.
    fresh = sweep(write(tmp_path / "tiny.toml", TINY), begun, "--fresh")
    assert fresh.exit_code == 0, fresh.output
    assert "16 cell(s) measured" in fresh.output
    assert (begun / "journal.jsonl.1").read_bytes() == before
    assert open_cube(begun / "cube.nc").attrs["engine_version"] == f"dvfs-twin 0.1.0+{OTHER_DIGEST}"


def _as_another_twin_from(journal: Path, sessions_kept: int) -> None:
    """Rewrite the journal as if a dvfs that did not check had resumed it on another twin:
    from its `sessions_kept`+1-th session on, GPUs and servers name another digest."""
    seen, out = 0, []
    for record in read_records(journal):
        if record["type"] == "session":
            seen += 1
        if seen > sessions_kept:
            if record["type"] == "session":
                for gpu in record["gpus"]:
                    gpu["driver_version"] = f"twin+{OTHER_DIGEST}"
            if record["type"] == "server":
                record["version"] = f"dvfs-twin 0.1.0+{OTHER_DIGEST}"
        out.append(record)
    journal.write_text("".join(json.dumps(r) + "\n" for r in out))


def test_a_journal_mixing_twins_is_refused_at_cube_build(begun: Path, tmp_path: Path) -> None:
    resumed = sweep(write(tmp_path / "tiny.toml", TINY), begun)
    assert resumed.exit_code == 0, resumed.output
    journal = begun / "journal.jsonl"
    _as_another_twin_from(journal, 1)
    result = invoke("cube", "build", str(begun))
    assert_one_line_error(
        result, 1, f"twin+{identity.twin_digest()} -> twin+{OTHER_DIGEST}", *TWIN_ADVICE
    )
    # Its servers alone (a twin engine on real GPUs, whose driver did not change) are refused
    # too, by the engine's version.
    records = read_records(journal)
    for record in records:
        if record["type"] == "session":
            for gpu in record["gpus"]:
                gpu["driver_version"] = twin_driver_version()
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    servers = invoke("cube", "build", str(begun))
    assert_one_line_error(
        servers, 1, f"dvfs-twin 0.1.0+{identity.twin_digest()} -> dvfs-twin 0.1.0+", *TWIN_ADVICE
    )


def test_an_earlier_dvfs_twin_journal_is_refused_and_says_what_to_do(
    begun: Path, tmp_path: Path
) -> None:
    """Journals of a dvfs before the digest name "twin" and "dvfs-twin 0.1.0": they may hold
    another twin's cells, so they are refused, with the way out."""
    journal = begun / "journal.jsonl"
    records = read_records(journal)
    for record in records:
        if record["type"] == "session":
            for gpu in record["gpus"]:
                gpu["driver_version"] = "twin"
        if record["type"] == "server":
            record["version"] = "dvfs-twin 0.1.0"
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = sweep(write(tmp_path / "tiny.toml", TINY), begun)
    line = assert_one_line_error(
        result, 1, f"driver version: twin -> {twin_driver_version()}", *TWIN_ADVICE
    )
    assert "names no +digest" in line


def test_cubes_of_two_twins_do_not_merge(tiny_sweep: Path, tmp_path: Path) -> None:
    """`dvfs cube merge` joins GPUs, not twins: another GPU of the same twin merges, a cube of
    another twin is refused."""
    from dvfs.cube import write_cube

    ds = open_cube(tiny_sweep / "cube.nc")
    other = ds.copy()
    other.attrs["gpu_uuids"] = "GPU-00000000-0000-0000-0000-000000000001"
    write_cube(other, tmp_path / "same.nc")
    same = invoke(
        "cube", "merge", str(tiny_sweep), str(tmp_path / "same.nc"), "-o", str(tmp_path / "m.nc")
    )
    assert same.exit_code == 0, same.output
    other.attrs["driver_version"] = f"twin+{OTHER_DIGEST}"
    other.attrs["engine_version"] = f"dvfs-twin 0.1.0+{OTHER_DIGEST}"
    write_cube(other, tmp_path / "other.nc")
    merged = invoke(
        "cube", "merge", str(tiny_sweep), str(tmp_path / "other.nc"), "-o", str(tmp_path / "x.nc")
    )
    assert_one_line_error(
        merged, 2, "cannot merge cubes of two twins", f"twin+{OTHER_DIGEST}", "--fresh"
    )
    assert not (tmp_path / "x.nc").exists()
