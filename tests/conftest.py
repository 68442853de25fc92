"""Shared fixtures: small campaigns on the twin, and a CLI runner.

The suite's time goes to end-to-end runs, so a test that only reads a finished run should take
a session's instead of sweeping its own. Session fixtures (built once per test session, on
first use, by whichever xdist worker asks first, and shared by all workers; read-only: a test
that changes one works on `copy_sweep` of it):

- `small_sweep`: SMALL_EXACT (SMALL_CAMPAIGN on the exact twin) swept; its output folder.
- `tiny_sweep`: TINY swept; its output folder.
- `shared_run`: `shared_run(TEXT, NAME, *ARGS)` sweeps the campaign TEXT with ARGS into a
  folder NAME, once per session, and returns that folder; runs of one TEXT share a parent
  holding the campaign as `campaign.toml` and each run's printed output as `NAME.txt` (the
  reference runs several files compare with).
- `tiny_exact_run`: `tiny_exact_run(NAME)`, TINY_EXACT's `shared_run` NAME (the whole
  campaign or a shard of two, on one GPU or a fleet mixing GPU models: `TINY_EXACT_RUNS`).
- `made_once(tmp_path_factory, NAME, MAKE)` (a function, not a fixture): a folder MAKE fills
  once per session, for a module fixture that writes files (module scope alone builds it again
  on each worker that runs one of the module's tests).
- `live_pid`: a live `sleep` process that is no server's (a tenant, a container's host PID).
- `ray_cluster`: one loopback Ray instance with four twin GPUs (and two of the fake NVML's:
  `ray_nvml`), shared by the tests that use it, which run first and in a row on each xdist
  worker that gets some (worksteal may share them out: each such worker starts its own; the
  modules' xdist_group marks only bind under --dist loadgroup), and stopped after the last.

Run follow-up commands in process (`click.testing.CliRunner`); a subprocess is for what is
about processes (signals, a kill, exit paths, a server's life) and pays ~1 s of imports.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import Phase, settings

REPO = Path(__file__).resolve().parent.parent

# No property test's verdict may hang on the machine's speed: hypothesis's default 200 ms
# deadline per example is a wall-clock bound that a loaded machine (a demo sweep beside the
# suite) can break, so no example has one. Loaded before any test module, so every
# `@settings` inherits it.
# Nor the explain phase: on Python < 3.12 it traces every line (sys.settrace) of each example
# replayed after a failure, which made one failing property test (xarray under the tracer) run
# past pytest-timeout's 120 s, so the report showed a flaky timeout, not the failure.
# The default profile is "dvfs" (hypothesis's 100 examples a test); DVFS_HYPOTHESIS_PROFILE=deep
# loads "deep" instead, the same settings at 2,000 examples a test, to hunt latent defects (run
# it file by file, with `-p no:timeout`: not for the suite's ordinary run). Under "deep", a test
# whose own @settings names fewer examples runs the profile's count too (`_deepen`).
_PHASES = [phase for phase in Phase if phase is not Phase.explain]
settings.register_profile("dvfs", deadline=None, phases=_PHASES)
DEEP_EXAMPLES = 2000
settings.register_profile("deep", deadline=None, phases=_PHASES, max_examples=DEEP_EXAMPLES)
HYPOTHESIS_PROFILE = os.environ.get("DVFS_HYPOTHESIS_PROFILE", "dvfs")
settings.load_profile(HYPOTHESIS_PROFILE)
FAKES = REPO / "tests" / "fakes"

SMALL_CAMPAIGN = """
[campaign]
name = "small"

[gpu]
backend = "twin"
profile = "h100-sxm"
devices = [0]

[knobs]
sm_clock = [1980, 1500, 1005]
power_limit = [700, 300]
settle_s = 1.0

[engine]
backend = "twin"
model = "llama-3.1-8b"

[drafters.none]
algorithm = "none"

[drafters.eagle3]
algorithm = "EAGLE3"
draft_model = "eagle3-llama-3.1-8b"
num_steps = 3
eagle_topk = 1
num_draft_tokens = 4

[workload]
batch = [1, 8]
corpora = ["code", "conversation"]
input_tokens = [16, 2048]
output_tokens = 64

[measurement]
warmup_tokens = 8
min_window_s = 0.2
max_rounds = 2
repeats = 2
sample_period_s = 0.02
idle_s = 1.0
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def unsaved_figure(fig: object, out_dir: Path, name: str, fmt: str) -> Path:
    """`dvfs.plots.save` less the rendering: an empty file where the figure would be written.
    For a test that reads what some figures draw, not their pixels: it patches `save` to
    render those and hand the others here (rendering every figure is most of `dvfs plot`'s
    and `dvfs report`'s CPU)."""
    del fig
    path = out_dir / f"{name}.{fmt}"
    path.write_bytes(b"")
    return path


@pytest.fixture
def unsaved_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every figure `dvfs plot` and `dvfs report` draw left undrawn (`figures_drawn_only`, of
    none) and unrendered (`unsaved_figure`), for a test that reads what a report or plot says
    in text, not its figures: building and rendering them is most of a report's CPU (~0.5 s
    to render, ~0.3 s to build, a report of the small sweep). Figures that some cube draws
    none of (the energy split, acceptance, timelines, energy against batch) are left out of
    the report; the energy-vs-clock and Pareto figures' places are kept, empty."""
    import dvfs.plots

    monkeypatch.setattr(dvfs.plots, "save", unsaved_figure)
    figures_drawn_only(monkeypatch)


#: The figures `dvfs.plots.figures` draws, by the names of their drawers in `dvfs.plots` (with
#: the helpers only those figures use): what `figures_drawn_only` may leave undrawn.
FIGURE_DRAWERS: dict[str, tuple[str, ...]] = {
    "draw_energy_vs_clock": (),
    "draw_energy_vs_power_limit": (),
    "draw_latency_vs_power_limit": (),
    "draw_pareto": (),
    "draw_energy_split": ("where_energy_goes", "worth_drawing", "split_panels"),
    "draw_acceptance": (),
    "draw_headroom": (),
    "draw_timelines": (),
    "draw_energy_vs_batch": (),
}


def figures_drawn_only(monkeypatch: pytest.MonkeyPatch, *drawers: str) -> None:
    """Every figure of `dvfs plot` and `dvfs report` but those `drawers` draw (names in
    `FIGURE_DRAWERS`) left undrawn: its drawer gives None (the energy split's, the headroom
    map's, the acceptance's, the timelines' and the energy-vs-batch figure are then left out;
    the energy-vs-clock and Pareto figures, drawn for every cube, are handed to `save` as None,
    which the test's own `save` takes to `unsaved_figure`). `figures` still works out the
    chosen settings and draws the figures asked for as it does: for a test that reads what
    those draw, not the others (building every figure, even unrendered, is most of a report's
    CPU). The panels the energy-vs-clock and Pareto figures share are built only for them."""
    import dvfs.plots

    assert set(drawers) <= set(FIGURE_DRAWERS), drawers
    for drawer, helpers in FIGURE_DRAWERS.items():
        if drawer not in drawers:
            for name in (drawer, *helpers):
                monkeypatch.setattr(dvfs.plots, name, lambda *args, **kwargs: None)
    curves = {
        "draw_energy_vs_clock",
        "draw_energy_vs_power_limit",
        "draw_latency_vs_power_limit",
        "draw_pareto",
    }
    if not curves & set(drawers):
        monkeypatch.setattr(dvfs.plots, "corpus_panels", lambda *args, **kwargs: None)


@pytest.fixture
def small_campaign(tmp_path: Path) -> Path:
    return write(tmp_path / "small.toml", SMALL_EXACT)


def replace_block(text: str, old: str, new: str) -> str:
    """Edit a campaign template, failing loudly if the edit does not apply."""
    assert old in text, f"template does not contain {old!r}"
    return text.replace(old, new, 1)


#: SMALL_CAMPAIGN on the exact twin (NVML's traps off), as the `small_campaign` and
#: `small_sweep` fixtures run it: the analyses read energy that the 100-ms energy counter cannot
#: resolve in 0.2-s windows, and the resume checks need cells that reproduce exactly
#: (tests/test_twin_traps.py covers the traps).
SMALL_EXACT = replace_block(SMALL_CAMPAIGN, 'profile = "h100-sxm"', 'profile = "h100-sxm:none"')


#: SMALL_CAMPAIGN cut to 16 cells (two clocks, one power limit, one corpus): the campaign of the
#: journal, resume and cube-file tests, which need a finished sweep but not its size.
TINY = replace_block(
    replace_block(
        replace_block(SMALL_CAMPAIGN, "sm_clock = [1980, 1500, 1005]", "sm_clock = [1980, 1005]"),
        "power_limit = [700, 300]",
        "power_limit = [700]",
    ),
    'corpora = ["code", "conversation"]',
    'corpora = ["code"]',
)


#: TINY on the exact twin: the campaign of the tests that merge, shard or resume its runs on
#: one model and on a fleet mixing an H100 and an H200 (`--gpus 0,h200-sxm:0`), whose cells
#: must reproduce exactly. Its runs are `shared_run`s: one of each per session.
TINY_EXACT = replace_block(TINY, 'profile = "h100-sxm"', 'profile = "h100-sxm:none"')
#: The `--gpus` of TINY_EXACT's runs on a fleet mixing GPU models.
MIXED_FLEET = ("--gpus", "0,h200-sxm:0")


@contextlib.contextmanager
def pipe_output() -> Iterator[tuple[str, list[bytes]]]:
    """A pipe's write end as a `/dev/fd/N` path for a command's `-o` (as `-o /dev/stdout`
    piped on), and the chunks a thread drains from it meanwhile (a full pipe would block the
    writer); all of them once the block ends, the write end closed."""
    r, w = os.pipe()
    got: list[bytes] = []

    def drain() -> None:
        while chunk := os.read(r, 1 << 16):
            got.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield f"/dev/fd/{w}", got
    finally:
        os.close(w)
        reader.join(timeout=60)
        os.close(r)


def race(make_round: Callable[[int], Callable[[], None]], rounds: int) -> list[BaseException]:
    """Four threads, each running `rounds` rounds (thread i's from `make_round(i)`) switched as
    often as the interpreter allows, as a local fleet's workers share dvfs's module caches; the
    errors they raised (the first stops them all)."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def run(index: int) -> None:
        one_round = make_round(index)
        try:
            for _ in range(rounds):
                if stop.is_set():
                    return
                one_round()
        except BaseException as exc:  # noqa: BLE001  (returned to the test)
            errors.append(exc)
            stop.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return errors


def copy_sweep(out: Path, dest: Path) -> Path:
    """A private copy of a session's finished sweep folder, for a test that changes it."""
    return Path(shutil.copytree(out, dest))


def folder_files(folder: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `folder`, by relative path; the lock
    file's holder pid read as a mark that it is one (a refused sweep takes the lock, and so
    writes its own pid, before it reads the journal it refuses; the folder may have been
    made by another process)."""
    from dvfs.out_folder import LOCK_NAME

    files: dict[str, bytes | None] = {}
    for p in sorted(folder.rglob("*")):
        data = None if p.is_dir() else p.read_bytes()
        if p.name == LOCK_NAME and data is not None and data.strip().isdigit():
            data = b"<pid>\n"
        files[str(p.relative_to(folder))] = data
    return files


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for running `python -m dvfs` in a subprocess from the repo."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


PYTHON = sys.executable


def _session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this test session shares: pytest's base temporary folder
    of the session (under xdist, the parent of each worker's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _made_once(folder: Path, make: Callable[[], None]) -> None:
    """Run `make` (which fills `folder`) once per test session, whichever xdist worker asks
    first; the others wait for it (a lock file beside `folder`) and find it made. A worker that
    died half-way leaves no done mark: the next one starts the folder again."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.parent / f"{folder.name}.done"
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return
        if folder.exists():
            shutil.rmtree(folder)
        make()
        done.touch()


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The folder NAME (unique in the suite), filled by `make(folder)` once per test session
    and shared by every xdist worker: for a module's expensive fixture that only writes files,
    which a module-scoped fixture would build again on each worker that runs one of its tests
    (worksteal spreads a module's tests over workers). Read-only to the tests."""
    folder = _session_dir(tmp_path_factory) / name

    def fill() -> None:
        folder.mkdir(parents=True)
        make(folder)

    _made_once(folder, fill)
    return folder


def _swept(campaign: Path, out: Path, *args: str) -> str:
    """`dvfs sweep CAMPAIGN ARGS --out OUT` in this process; its printed output."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    result = CliRunner().invoke(
        cli,
        ["sweep", str(campaign), *args, "--out", str(out), "--no-progress"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return result.output


def _sweep_into(base: Path, file_name: str, text: str) -> None:
    """The campaign TEXT written as BASE/FILE_NAME and swept into BASE/out."""
    _swept(write(base / file_name, text), base / "out")


@pytest.fixture(scope="session")
def small_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished sweep of SMALL_EXACT, run once per session (the xdist workers share it):
    returns its folder. Read-only; a test that changes it works on `copy_sweep` of it."""
    base = _session_dir(tmp_path_factory) / "small_sweep"
    _made_once(base, lambda: _sweep_into(base, "small.toml", SMALL_EXACT))
    return base / "out"


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished sweep of TINY, run once per session (the xdist workers share it): returns its
    folder. Read-only; a test that adds to it or damages it works on `copy_sweep` of it."""
    base = _session_dir(tmp_path_factory) / "tiny_sweep"
    _made_once(base, lambda: _sweep_into(base, "tiny.toml", TINY))
    return base / "out"


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`shared_run(TEXT, NAME, *ARGS)`: the folder NAME of `dvfs sweep` of the campaign TEXT
    with ARGS, run once per session (the xdist workers share it) for every test that asks for
    the same run. Read-only; a test that changes one works on `copy_sweep` of it."""
    done: dict[tuple[str, str, tuple[str, ...]], Path] = {}

    def run(text: str, name: str, *args: str) -> Path:
        key = (text, name, args)
        if key in done:
            return done[key]
        root = (
            _session_dir(tmp_path_factory)
            / f"swept-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        )

        def campaign() -> None:
            write(root / "campaign.toml", text)

        def sweep() -> None:
            output = _swept(root / "campaign.toml", root / name, *args)
            (root / f"{name}.txt").write_text(output)
            (root / f"{name}.args").write_text(json.dumps(args))

        _made_once(root, campaign)
        _made_once(root / name, sweep)
        ran = tuple(json.loads((root / f"{name}.args").read_text()))
        assert ran == args, f"{name} is another run of this campaign"
        done[key] = root / name
        return done[key]

    return run


#: TINY_EXACT's shared runs by name: the whole campaign and its two shards, on one twin H100
#: and on the fleet mixing an H100 and an H200.
TINY_EXACT_RUNS: dict[str, tuple[str, ...]] = {
    "one": (),
    "s0": ("--shard", "0/2"),
    "s1": ("--shard", "1/2"),
    "mixed": MIXED_FLEET,
    "mixed-s0": ("--shard", "0/2", *MIXED_FLEET),
    "mixed-s1": ("--shard", "1/2", *MIXED_FLEET),
}


@pytest.fixture(scope="session")
def tiny_exact_run(shared_run: Callable[..., Path]) -> Callable[[str], Path]:
    """`tiny_exact_run(NAME)`: the folder of TINY_EXACT's run NAME (`TINY_EXACT_RUNS`), a
    `shared_run`; its parent holds the campaign as `campaign.toml`. Read-only; a test that
    resumes, edits or damages one works on `copy_sweep` of it."""
    return lambda name: shared_run(TINY_EXACT, name, *TINY_EXACT_RUNS[name])


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` set, as it was again afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: Seconds the shared Ray instance is given to free what the tests before left held (Ray frees
#: a killed actor's resources once its process is gone) before it is started again for the next
#: test (`_RayInstance.start`): a cost only, never a verdict.
RAY_FREE_GRACE_S = 20.0


def ray_held(ray: object) -> dict[str, float]:
    """The resources of the Ray instance `ray` that something holds: each one's amount not
    free (none: every worker a sweep places can start); the object store's memory aside."""
    from dvfs.fleet.ray_executor import TWIN_RESOURCE

    total = ray.cluster_resources()  # type: ignore[attr-defined]
    free = ray.available_resources()  # type: ignore[attr-defined]
    return {
        name: total[name] - free.get(name, 0.0)
        for name in ("CPU", "GPU", TWIN_RESOURCE)
        if free.get(name, 0.0) < total.get(name, 0.0)
    }


class _RayInstance:
    """The loopback Ray instance the `ray_cluster` tests share: started on first use, stopped
    after the last of a run of consecutive tests that use it (an idle Ray burns CPU in its
    daemons for as long as it runs: about 0.04 CPU-s a second, besides ~4 CPU-s to start).

    Each test gets it whole, whatever the tests before it left: an actor one killed as Ray
    was creating it can keep its GPUs for as long as the instance runs (Ray 2.60 leases a
    worker for it, then the kill reaches that worker before the actor's creation does and is
    ignored: "Mismatched ActorID: ignoring KillActor", in the worker's log; the worker and its
    lease last until this process's Ray job ends), and the next sweep's workers then waited
    for that GPU until the test's timeout. So what is still held `RAY_FREE_GRACE_S` after the
    test before is freed by starting Ray again."""

    def __init__(self) -> None:
        self.ray: object | None = None
        self.nvml_env: dict[str, str] = {}

    def start(self) -> object:
        if self.ray is not None:
            deadline = time.monotonic() + RAY_FREE_GRACE_S
            while (held := ray_held(self.ray)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if held:
                print(
                    f"ray_cluster: {held} still held {RAY_FREE_GRACE_S:g} s after the tests "
                    "before (a killed actor's worker Ray kept); Ray started again",
                    file=sys.stderr,
                )
                self.stop()
        if self.ray is None:
            ray = pytest.importorskip("ray")
            from nvml_support import FAKE_DIR

            from dvfs.fleet.ray_executor import NAMESPACE, TWIN_RESOURCE, import_ray

            # Two NVML GPUs too, the fake's (its state in a folder of this instance's), for
            # the tests of real GPUs on Ray (`ray_nvml`); the twin's actors never import it.
            fake = Path(tempfile.mkdtemp(prefix="dvfs-ray-nvml-"))
            self.nvml_env = {
                "DVFS_FAKE_NVML_STATE": str(fake / "fake-nvml.json"),
                "DVFS_FAKE_NVML_DEVICES": "h100-sxm,h100-sxm",
                "DVFS_FAKE_NVML_ROOT": "1",
                "DVFS_STATE_DIR": str(fake / "dvfs-state"),
            }
            path = os.pathsep.join(p for p in (str(FAKE_DIR), os.environ.get("PYTHONPATH")) if p)
            import_ray(local=True)
            # The actors' environment is the one Ray's processes start with, set here while
            # they start (each worker inherits it), not a job's `runtime_env`: with one, each
            # actor's process took about 0.5 CPU-s more to start (Ray 2.60, measured), and
            # the workers Ray prestarts as it starts, which lack the job's environment, went
            # unused.
            with _environ({"PYTHONPATH": path, **self.nvml_env}):
                ray.init(
                    namespace=NAMESPACE,
                    num_cpus=2,
                    num_gpus=2,
                    resources={TWIN_RESOURCE: 4},
                    include_dashboard=False,
                    log_to_driver=False,
                )
            self.ray = ray
            assert ray.util.get_node_ip_address() == "127.0.0.1"
        return self.ray

    def stop(self) -> None:
        ray, self.ray = self.ray, None
        if ray is not None:
            ray.shutdown()  # type: ignore[attr-defined]
            shutil.rmtree(Path(self.nvml_env["DVFS_STATE_DIR"]).parent, ignore_errors=True)


_RAY = _RayInstance()


@pytest.fixture
def ray_cluster() -> object:
    """One Ray instance on loopback with four twin GPUs: the `ray` module. Starting Ray costs
    seconds of CPU, so consecutive tests share it: `pytest_collection_modifyitems` puts every
    test that asks for it first (one xdist worker then runs them in a row, at the start of
    its share, where work stealing takes nothing), and the instance stops after the last
    (`pytest_runtest_teardown`). A test that kills an actor leaves it usable (each sweep starts
    its own actors), and each test gets every resource of it free (`_RayInstance.start`)."""
    return _RAY.start()


@pytest.fixture
def ray_nvml(ray_cluster: object, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake pynvml of `ray_cluster`'s two NVML GPUs (its actors' `import pynvml`), on a
    fresh state, and the driver's `pynvml` here (the environment set as the actors have it)."""
    from nvml_support import load_fake

    for key, value in _RAY.nvml_env.items():
        monkeypatch.setenv(key, value)
    shutil.rmtree(_RAY.nvml_env["DVFS_STATE_DIR"], ignore_errors=True)
    fake = load_fake()
    fake.fake_reset_state()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def _deepen(test: object) -> None:
    """Raise a property test's own `max_examples` to the "deep" profile's, never lower it. A
    test's `@settings(max_examples=N)` overrides any profile, so without this the deep run
    would leave the tests that set one (about a hundred) at their own count. Hypothesis reads the
    settings from this attribute of the @given wrapper each time the test runs (no public way
    to change them once decorated); only the deep profile touches it."""
    own = getattr(test, "_hypothesis_internal_use_settings", None)
    deepens = own is not None and own.max_examples < DEEP_EXAMPLES
    if getattr(test, "is_hypothesis_test", False) and deepens:
        test._hypothesis_internal_use_settings = settings(  # type: ignore[attr-defined]
            own, max_examples=DEEP_EXAMPLES
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use `ray_cluster` first, in their order; the rest as collected. Every
    xdist worker sorts the same collection the same way, as xdist requires. Under the "deep"
    profile, a property test's own `@settings(max_examples=N)` is raised to the profile's
    count (`_deepen`)."""
    if HYPOTHESIS_PROFILE == "deep":
        for item in items:
            _deepen(getattr(item, "obj", None))
    uses = ["ray_cluster" in getattr(item, "fixturenames", ()) for item in items]
    items[:] = [i for i, u in zip(items, uses, strict=True) if u] + [
        i for i, u in zip(items, uses, strict=True) if not u
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """Stop Ray once the next test (None: this worker has no more) does not use it."""
    yield
    if nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ()):
        _RAY.stop()


def pytest_configure(config: pytest.Config) -> None:
    """Let the suite's workers and subprocesses keep compiled bytecode. Where the environment
    sets PYTHONDONTWRITEBYTECODE, every xdist worker and every `python -m dvfs` a test starts
    would compile dvfs (and rewrite the test modules' asserts) from source again: seconds of
    CPU per worker. Only the test session's children are affected; the caches are the usual
    gitignored `__pycache__` folders.

    CUDA_VISIBLE_DEVICES goes too: dvfs holds real GPUs to it (`dvfs.gpu.visible`), and the
    fake NVML's GPUs are none a scheduler could name, so on a GPU machine whose jobs get the
    variable every fake-NVML test would be refused. Tests of that rule set it themselves."""
    del config
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers per core this process may run on. Many end-to-end tests wait on a
    subprocess, a stub server's real-time stream or Ray, and a spare worker runs another test
    meanwhile."""
    del config
    return 2 * len(os.sched_getaffinity(0))


# In CI (.ci/run sets DVFS_REQUIRE_OPTIONAL=1) the optional paths' tools are installed, so a test
# that skips for want of Chromium, torch or Ray means the set-up broke: fail it instead.
_OPTIONAL = ("chromium", "torch", "ray")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get("DVFS_REQUIRE_OPTIONAL") != "1":
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if any(name in reason.lower() for name in _OPTIONAL):
        report.outcome = "failed"
        report.longrepr = f"DVFS_REQUIRE_OPTIONAL=1 but the test skipped: {reason}"


def default_dispositions() -> None:
    """In a child before exec (`preexec_fn`): SIGINT and SIGTERM as a foreground shell gives
    them, whatever the test process inherited (a background job ignores SIGINT), for tests
    that signal the child."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A live process that is not a server's (NVML lists live PIDs only): another tenant's job,
    or the host PID NVML names a container's server by. Its pid."""
    process = subprocess.Popen(["sleep", "120"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()
