"""Issue 15's shortcuts that must change nothing: the figures' style written out instead of
imported from seaborn, the twin's traces built from a planned round's remembered fields, the
garbage collector's threshold raised only while a twin engine is open or figures are drawn, and a
GPU profile's hash worked out once."""

from __future__ import annotations

import copy
import gc
import pickle
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

import dvfs.plots
from dvfs.campaign.model import DrafterSpec
from dvfs.clock import VirtualClock
from dvfs.collector import GC_THRESHOLD_0
from dvfs.corpora import load_corpus, sample_prompts
from dvfs.engines.base import RequestTrace, Workload
from dvfs.engines.twin import TwinEngine
from dvfs.plots import plot_all, style
from dvfs.twin import profiles, traps
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.profiles import gpu_profile, model_profile

H100 = gpu_profile("h100-sxm")
LLAMA8B = model_profile("llama-3.1-8b")
EAGLE3 = DrafterSpec("eagle3", "EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 5, 4, 8)


def test_the_written_out_style_is_seaborns() -> None:
    seaborn = pytest.importorskip("seaborn")
    theirs = dict(seaborn.axes_style("whitegrid"))
    assert theirs.pop("image.cmap") == "rocket"  # left out: every dvfs image names its map
    assert theirs == style.WHITEGRID
    assert style.palette() == tuple(seaborn.color_palette(style.PALETTE).as_hex())
    assert {k: style.theme()[k] for k in style.RC} == style.RC  # dvfs's sizes win


def engine(clock_mhz: int, limit_w: float) -> tuple[TwinEngine, TwinDevice]:
    device = TwinDevice(traps.without(H100), VirtualClock(), 0)
    device.locked_mhz, device.power_limit_w = (clock_mhz, clock_mhz), limit_w
    return TwinEngine(TwinNode([device]), LLAMA8B), device


def workload(seed: int) -> Workload:
    prompts = sample_prompts(load_corpus("code"), 8, input_tokens=(16, 512), seed=seed)
    return Workload(8, prompts, "code", 96, 0.0, True, "fixed", seed=seed)


@pytest.mark.parametrize("end_at_window", [False, True])
def test_a_reused_rounds_traces_are_trusted_traces_of_their_own(end_at_window) -> None:
    """Rounds that reuse a planned round (only the knobs changed) share its trace fields but
    get traces of their own: each equal, field by field and in the same attribute order, to the
    one `RequestTrace.trusted` builds from the round's numbers."""
    twin, device = engine(1980, 700.0)
    twin.start(EAGLE3)
    w = replace(workload(4), end_at_window=end_at_window)
    first = twin.run(w)
    device.locked_mhz = (1200, 1200)
    second = twin.run(w)
    assert second.ended_ns - second.started_ns > first.ended_ns - first.started_ns
    for a, b in zip(first.requests, second.requests, strict=True):
        assert a is not b and a.chunk_ns is not b.chunk_ns
        assert np.array_equal(a.chunk_tokens, b.chunk_tokens)
    for result in (first, second):
        for r in result.requests:
            names = [f.name for f in fields(RequestTrace)]
            args = [getattr(r, n) for n in names[:9]]
            trusted = RequestTrace.trusted(*args)
            assert list(vars(r)) == list(vars(trusted)) == names
            for n in names:
                x, y = getattr(r, n), getattr(trusted, n)
                assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
            assert r.sent_ns == result.started_ns
            assert r.spec_verify_ct is not None
            RequestTrace(*args)  # and the checked constructor accepts it


def test_the_gc_threshold_is_raised_only_while_a_twin_engine_is_open() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        twin, _ = engine(1980, 700.0)
        with twin:
            assert gc.get_threshold() == (GC_THRESHOLD_0, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(50_000, 5, 5)  # a higher threshold someone chose is kept
        with pytest.raises(RuntimeError), engine(1980, 700.0)[0]:
            assert gc.get_threshold() == (50_000, 5, 5)
            raise RuntimeError("the sweep failed")
        assert gc.get_threshold() == (50_000, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_engines_closed_in_another_order_than_opened_leave_the_collector_as_found() -> None:
    """A local fleet's workers are threads whose twin engines close in any order: the first to
    close must not put back the default while others run, nor the last one the raised one."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        first, second = engine(1980, 700.0)[0], engine(1980, 700.0)[0]
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert gc.get_threshold() == (GC_THRESHOLD_0, 10, 10)  # the second still runs
        second.__exit__(None, None, None)
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_figures_are_drawn_with_fewer_collections_and_the_collector_is_left_as_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """While plot_all draws, the collector runs less often and leaves out the objects that
    existed before (frozen); after it, even when a figure fails, the threshold and the frozen
    objects are as they were, someone else's frozen objects included."""
    from cubes import make_cube

    cube = make_cube(clocks=[1500, 1980], batches=[1, 8])
    during: list[tuple[int, int]] = []

    def note(fig: object, out_dir: Path, name: str, fmt: str) -> Path:
        during.append((gc.get_threshold()[0], gc.get_freeze_count()))
        if name == "fail":
            raise RuntimeError("the disk is full")
        return out_dir / name

    monkeypatch.setattr(dvfs.plots, "save", note)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert gc.get_freeze_count() == 0
        plot_all(cube, tmp_path)
        assert during and all(t == GC_THRESHOLD_0 and frozen > 0 for t, frozen in during)
        assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
        monkeypatch.setattr(dvfs.plots, "figures", lambda *a, **k: iter([("fail", None)]))
        with pytest.raises(RuntimeError, match="disk is full"):
            plot_all(cube, tmp_path)
        assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
        gc.freeze()  # someone else's: kept frozen
        with pytest.raises(RuntimeError):
            plot_all(cube, tmp_path)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_profiles_hash_is_its_fields_hash_worked_out_once(monkeypatch) -> None:
    """A profile keys the physics' caches, looked up a few times a round: its fields are hashed
    once, to the number the dataclass's own hash gives; equal profiles still hash equal, and a
    copy or a pickle carries the fields alone (a string's hash differs between processes)."""
    profile = replace(H100)  # a fresh one, never hashed
    tuples = []

    def counting_hash(value: object) -> int:
        if isinstance(value, tuple):
            tuples.append(value)
        return hash(value)

    monkeypatch.setattr(profiles, "hash", counting_hash, raising=False)
    first = hash(profile)
    assert hash(profile) == first
    assert len(tuples) == 1  # the fields, hashed once
    monkeypatch.undo()
    assert first == hash(tuple(getattr(H100, f.name) for f in fields(H100))) == hash(H100)
    assert replace(H100, ambient_c=H100.ambient_c + 1.5) != H100
    assert len({H100: 1, replace(H100): 2}) == 1
    names = {f.name for f in fields(H100)}
    for other in (copy.copy(profile), copy.deepcopy(profile), pickle.loads(pickle.dumps(profile))):
        assert set(vars(other)) == names and other == profile and hash(other) == first
