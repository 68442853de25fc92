"""What a sweep would do, without touching a GPU: `plan_dry_run` lists the cells, what a
resumed folder already holds and what would be refused, and estimates the GPU time by sweeping
the campaign's twin stand-in (the same campaign on the twin of its GPU and model) into a
temporary folder: exact for a twin campaign, and beside it what the naive protocol would spend.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs.backends import (
    ServerPlan,
    real_gpus,
    server_plans,
    tokenizer_model,
    twin_context_overruns,
    twin_inflight_overruns,
    twin_start_refusal,
)
from dvfs.campaign import Campaign
from dvfs.corpora.model import Corpus
from dvfs.corpora.prepare import (
    corpus_shortfalls,
    counted_corpora,
    recorded_count_method,
    shortfall_line,
)
from dvfs.cube import CUBE_NAME
from dvfs.errors import (
    CampaignError,
    CorpusError,
    JournalError,
)
from dvfs.estimate import RunCosts
from dvfs.fleet.queue import group_of
from dvfs.fleet.shard import Shard, planned_cells
from dvfs.fleet.shard_journal import (
    folder_journals,
    model_folder_journals,
    model_journal_paths,
)
from dvfs.measure.journal import (
    JOURNAL_NAME,
    Journal,
)
from dvfs.measure.plan import Cell
from dvfs.measure.runner import Progress, journaled_repeats
from dvfs.out_folder import folder_refusals, fresh_moves
from dvfs.preflight import gpu_identities, model_names, read_gpu_identities, resume_refusals
from dvfs.sweep import run_sweep

if TYPE_CHECKING:
    import xarray as xr


@dataclass(frozen=True)
class DryRunPlan:
    """What a sweep would do, found without touching a GPU or starting a server."""

    campaign: str
    hash: str
    gpu_backend: str
    gpu_profile: str | None
    gpu_devices: tuple[int | str, ...]
    actuation: bool
    grid: dict[str, Any]
    cells: int
    #: The planned cells the journal(s) in the output folder already hold, which a rerun
    #: skips: summed over the GPU models of a fleet mixing them (each model's journal, as
    #: `done_per_model` says); 0 with --fresh; None when the sweep would refuse that folder
    #: before measuring anything (another shard's, dealt otherwise, or another campaign's or
    #: other settings': `problems` says which), so nothing there counts as done or to run.
    already_done: int | None
    #: The server starts and knob changes of the cells still to run (with the extra repeats
    #: the journal asks for now: `extra_to_run`), on the GPU model with the most left (each
    #: model runs them on its own workers).
    server_starts: int
    knob_changes: int
    #: The comparison groups (batch, corpus, repeat) among the planned cells: a fleet runs
    #: each whole on one worker, a shard holds whole ones.
    comparison_groups: int
    #: The closed-form duration of the cells still to run (all of them when the folder is
    #: refused; with `extra_to_run`; on the GPU model with the most left;
    #: `dvfs.measure.plan`): rough (it assumes rounds and leaves out prefill, drain and
    #: baselines), shown only when the twin gives no estimate.
    estimated_s: float
    servers: tuple[ServerPlan, ...]
    problems: tuple[str, ...]
    shard: str | None = None
    #: GPU time on the twin stand-in of the campaign's GPU and model, found by sweeping its
    #: planned cells (all of them, or the shard's) still to run (those the journal of the GPU
    #: model with the most left does not hold) into a temporary folder; None when not
    #: estimated (--no-estimate, corpus problems, or nothing left to run).
    estimate: TwinEstimate | None = None
    #: Why the twin did not estimate a campaign it could have (too many cells to sweep
    #: promptly): the closed form's figure stands in; None otherwise.
    estimate_skipped: str | None = None
    #: Where the sweep journals per GPU model (`gpu-<model>/`: a fleet mixing models, or a
    #: folder one began), each model's folder and the planned cells its journal holds; the
    #: cells run once per model. Empty when it journals in the folder itself.
    done_per_model: dict[str, int] = dataclasses.field(default_factory=dict)
    #: With --fresh, what it would move aside and to what (`fresh_moves`); None without.
    fresh_moves: tuple[tuple[Path, Path], ...] | None = None
    #: The exit code of a dry run with these `problems`, the sweep's for them: 0 without; 2
    #: when one makes the run invalid input (a corpus shortfall, another shard's folder); else
    #: 1 (a folder whose journal is another campaign's or of other settings).
    exit_code: int = 0
    #: measurement.max_repeats: above the planned repeats, the sweep adds the next repeat of
    #: each group whose interval across repeats misses the precision, up to this many.
    max_repeats: int = 1
    #: Those extra repeats the journal(s) already hold (done, beside `already_done`'s planned
    #: cells), and the next ones the journal(s) ask for now: the sweep runs them after the
    #: planned cells left (counted in `server_starts`, `knob_changes` and `estimated_s`), and
    #: more may follow up to `max_repeats`. 0 without adaptive repeats; None when refused.
    extra_done: int | None = 0
    extra_to_run: int | None = 0
    #: measurement.precision: the relative half-width the repeats' interval must reach.
    precision: float = 0.0
    #: The cells still to run (those of `server_starts`), in measuring order: what a fleet
    #: deals out to its workers now.
    cells_left: tuple[Cell, ...] = ()
    #: One GPU's sweep of `cells_left` split as a fleet's workers spend it (`dvfs.estimate`):
    #: the twin's (`estimate.costs`), else the closed form's.
    costs: RunCosts = RunCosts({})
    #: The folder (`gpu-<model>`) of the GPU model with the most left, whose cells left the
    #: figures are of; None where the sweep journals in the folder itself.
    most_left_folder: str | None = None
    #: Each GPU model's folder (as `done_per_model`) and how many cells it has left to run,
    #: the extra repeats its journal asks for now included: a model with none left runs
    #: nothing, its workers idle.
    left_per_model: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The folder's other GPU models' journals (`gpu-<model>/`, none of this run's GPUs of
    #: that model) and the planned cells each has left: this run measures none of them, as
    #: the sweep's note says ("rerun with them to finish"). Empty with --fresh or refused.
    left_for_other_models: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def comparison_groups_left(self) -> int:
        return len({group_of(c) for c in self.cells_left})

    @property
    def runs(self) -> int:
        """How many times the planned cells are measured: once per GPU model journalled
        apart, else once."""
        return max(1, len(self.done_per_model))

    @property
    def remaining(self) -> int | None:
        if self.already_done is None:
            return None
        return self.cells * self.runs - self.already_done

    @property
    def out_refused(self) -> bool:
        """Whether the sweep would refuse the output folder before measuring anything."""
        return self.already_done is None

    @property
    def twin_gpu_s(self) -> float | None:
        return self.estimate.dvfs_gpu_s if self.estimate else None

    def as_dict(self) -> dict[str, Any]:
        """The document `dvfs sweep --dry-run --json` prints."""
        e = self.estimate
        hours = (e.dvfs_gpu_s if e else self.estimated_s) / 3600
        return {
            "campaign": self.campaign,
            "hash": self.hash,
            "gpu": {
                "backend": self.gpu_backend,
                "profile": self.gpu_profile,
                "devices": list(self.gpu_devices),
                "actuation": "on" if self.actuation else "off (observe-only)",
            },
            "grid": dict(self.grid),
            "cells": self.cells,
            "already_done": self.already_done,
            "remaining": self.remaining,
            "out_refused": self.out_refused,
            **(
                {
                    "adaptive_repeats": {
                        "max_repeats": self.max_repeats,
                        "precision": self.precision,
                        "extra_done": self.extra_done,
                        "extra_to_run_now": self.extra_to_run,
                    }
                }
                if self.max_repeats > self.grid["repeat"]
                else {}
            ),
            **({"done_per_model": dict(self.done_per_model)} if self.done_per_model else {}),
            **(
                {"left_for_other_models": dict(self.left_for_other_models)}
                if self.left_for_other_models
                else {}
            ),
            **(
                {"fresh_moves_aside": [{"path": str(a), "to": str(b)} for a, b in self.fresh_moves]}
                if self.fresh_moves is not None
                else {}
            ),
            "server_starts": self.server_starts,
            "knob_changes": self.knob_changes,
            "comparison_groups": self.comparison_groups,
            "comparison_groups_left": self.comparison_groups_left,
            "estimated_hours_on_hardware": round(hours, 2),
            "estimate": {
                **_estimate_dict(e, self.estimated_s),
                **({"twin_skipped": self.estimate_skipped} if self.estimate_skipped else {}),
            },
            "servers": [s.as_dict() for s in self.servers],
            "problems": list(self.problems),
            **({"shard": self.shard} if self.shard else {}),
            **({"twin_gpu_s": round(e.dvfs_gpu_s, 3)} if e is not None else {}),
        }


def _estimate_dict(e: TwinEstimate | None, closed_form_s: float) -> dict[str, Any]:
    if e is None:
        return {"from": "closed form", "gpu_hours": round(closed_form_s / 3600, 2)}
    return {
        "from": "twin",
        "profile": e.profile,
        "profile_from": e.source,
        "cells_measured": e.cells,
        "cells_already_done": e.skipped,
        "gpu_hours": round(e.dvfs_gpu_s / 3600, 3),
        "window_share": round(e.window_s / e.dvfs_gpu_s, 4) if e.dvfs_gpu_s else None,
        "naive_gpu_hours": round(e.naive_gpu_s / 3600, 3),
        "naive_protocol": (
            f"per cell {NAIVE_REPEATS} times: a server start (none when attached), "
            f"knobs.settle_s, warm-up, prefill and one {NAIVE_WINDOW_S:g} s window"
        ),
        "dvfs_over_naive": round(e.dvfs_gpu_s / e.naive_gpu_s, 4) if e.naive_gpu_s else None,
    }


def finished_cells(campaign: Campaign, journal: Path, cells: Sequence[Cell]) -> set[str]:
    """Keys of the cells a rerun of `cells` would skip: those measured ok in `journal`, when
    it is one of this campaign (one that is not, the sweep refuses: `folder_refusals` says
    so), less an in-flight group's it holds only part of (`whole_groups_done`)."""
    from dvfs.measure.inflight import whole_groups_done
    from dvfs.measure.journal import iter_records, journal_differences

    if not journal.is_file():
        return set()
    opened = Journal(journal, iter_records(journal))  # every line read, and checked, first
    try:
        header = opened.header
    except JournalError:  # empty, or no header: nothing a rerun would skip
        return set()
    if journal_differences(header, campaign):
        return set()
    return whole_groups_done(campaign.measurement.mode, cells, opened.finished())


def resumed_journals(
    campaign: Campaign,
    out_dir: Path,
    models: Sequence[str | None],
    cells: Sequence[Cell],
    *,
    fresh: bool = False,
    fleet: bool = False,
) -> list[Path]:
    """The journal each GPU model of a sweep of `cells` into `out_dir` resumes, as the fleet
    picks them: all the folder's journals when they hold every cell (nothing to run, as
    `journals_done` finds), else `dvfs.fleet.folders.model_journals` of `models` as
    `workers_per_model` names them, twin GPUs by their profile, real ones by the name NVML
    gives (`read_group_models`). Where a real GPU's model was not read, a folder a fleet mixing
    models began resumes, as far as this can tell, into each of its `gpu-*/` journals (on the
    GPUs that began it). A folder of a run on other GPUs (another model, finished or not) is
    refused in the fleet's line, or (no `fleet`) the sweep's (`check_same_gpus`). `fresh`: as
    --fresh leaves the folder."""
    from dvfs.fleet.folders import check_same_gpus, journals_done, model_journals

    # Twin GPUs by their profile's name, real ones' as the dry run read them over NVML.
    names = model_names(campaign, models)
    if not fleet and not fresh and (out_dir / JOURNAL_NAME).is_file():
        # One GPU group: its GPUs compared with the journal's sessions, finished or not, as the
        # sweep compares them before it measures (real ones read here: the dry run left them).
        gpus = read_gpu_identities(campaign) if real_gpus(campaign) else None
        check_same_gpus(
            out_dir, gpu_identities(campaign, models) if gpus is None else gpus, fleet=False
        )
    # A folder holding every cell, on these models (a model it never measured is not done).
    done = None if fresh else journals_done(out_dir, campaign, cells, names)
    if done is not None:
        return list(done)
    if names is not None:
        journals = model_journals(out_dir, names, fresh=fresh)
        if fleet and not fresh:
            check_same_gpus(out_dir, gpu_identities(campaign, models))
        return journals
    begun = model_journal_paths(out_dir)
    return begun if begun and not fresh else [out_dir / JOURNAL_NAME]


def plan_dry_run(
    campaign: Campaign,
    out_dir: Path,
    *,
    shard: Shard | None = None,
    estimate: bool = True,
    twin: str | None = None,
    progress: Progress | None = None,
    models: Sequence[str | None] | None = None,
    fresh: bool = False,
    fleet: bool = False,
    servers_here: bool = True,
) -> DryRunPlan:
    """What `run_sweep` (or, `fleet`, a fleet whose workers' GPU models are `models`, default
    the campaign's devices) would do into `out_dir`: cells, those each model's journal already
    holds, server starts, knob changes, each drafter's server, the corpus problems that would
    stop it, and (with `estimate`) the GPU time of the cells (all of them, or the shard's)
    still to run on the campaign's twin stand-in, under dvfs's protocol and the naive one
    (`twin_estimate`; not when there are problems, nor when nothing is left to run). With
    `fresh`, the sweep that first moves the folder's journals aside (`fresh_moves`; nothing is
    moved here). A hardware campaign whose GPU matches no twin profile (and no `twin`) is
    refused in one line, unless the folder holds every cell: nothing is left to estimate, so
    it plans without the estimate. `servers_here` False: its servers start on other machines
    (`--executor ray`), their sglang theirs (`dvfs.backends.server_plans`)."""
    from dvfs.fleet.devices import worker_groups, workers_per_model
    from dvfs.fleet.folders import extra_repeats
    from dvfs.measure.plan import (
        MOST_ESTIMATED_CELLS,
        PlanSummary,
        summarise_plan,
        too_many_to_list,
    )

    # Counted, not listed, first: a campaign of a million repeats plans more cells than a dry
    # run lists before running out of memory (minutes), and more than its estimate sweeps.
    too_many = too_many_to_list(campaign, "a dry run")
    if too_many is not None:
        raise CampaignError(too_many)

    # No matching profile: refused, saying how to go on, unless the folder holds every cell
    # (nothing to estimate; checked below, once the journals are read) and no --twin was named.
    stand_in_problem: CampaignError | None = None
    if estimate:
        try:
            twin_stand_in(campaign, twin)
        except CampaignError as exc:
            stand_in_problem = exc
            if "no model profile" in str(exc):
                stand_in_problem = CampaignError(
                    f"{exc}: the GPU-time estimate runs the campaign on the twin, so name the "
                    "nearest in engine.twin_model, or pass --no-estimate"
                )
                stand_in_problem.__cause__ = exc
        if stand_in_problem is not None and twin is not None:
            raise stand_in_problem
    cells = planned_cells(campaign, shard)
    # A folder the sweep would refuse counts nothing as done: its cells are another share's,
    # or were measured under other settings. --fresh moves every journal there aside first,
    # so nothing is refused or done.
    try:
        refusals = [] if fresh else folder_refusals(campaign, out_dir, shard)
        refused = [str(exc) for exc in refusals]
        if models is None:
            models = list(workers_per_model(campaign, worker_groups(campaign)))
        journals = (
            []
            if refused
            else resumed_journals(campaign, out_dir, models, cells, fresh=fresh, fleet=fleet)
        )
        finished = {j: set() if fresh else finished_cells(campaign, j, cells) for j in journals}
        # With max_repeats above repeats: the extra repeats each journal holds (done, as the
        # sweep's closing line counts them) and the next ones its cells ask for now (the rule
        # the sweep follows, `extra_repeats`), which run after the planned cells left.
        # (a partly journaled in-flight group's levels among them: measured whole again)
        extra_next = {j: [] if fresh else extra_repeats(campaign, j, cells) for j in journals}
        for j in journals:
            finished[j] -= {c.key for c in extra_next[j]}
        extra_done = {
            j: journaled_repeats(campaign.measurement, cells, finished[j]) for j in journals
        }
    except Exception:
        if stand_in_problem is not None:  # said first, as before the folder was read
            raise stand_in_problem from None
        raise
    already_done = (
        None if refused else sum(len([c for c in cells if c.key in finished[j]]) for j in journals)
    )
    done_per_model = {
        j.parent.name: len([c for c in cells if c.key in finished[j]])
        for j in journals
        if j.parent != out_dir
    }
    # The folder's other GPU models, none of whose GPUs this run has (a fleet mixing models
    # rerun on some of them): their cells left, as the sweep's note says them (one whose
    # journal holds no session yet, or is missing from its folder, has every cell left).
    left_for_other_models = {}
    if not refused and not fresh:
        for path in model_folder_journals(out_dir):
            if path in journals or (os.path.lexists(path) and not path.is_file()):
                continue
            there = finished_cells(campaign, path, cells)
            left = len([c for c in cells if c.key not in there])
            if left:
                left_for_other_models[path.parent.name] = left
    # A folder holding every cell (each GPU model's, and no extra repeat asked for) runs
    # nothing: there is nothing to estimate, so no stand-in is needed.
    all_done = (
        already_done is not None
        and already_done == len(cells) * max(1, len(done_per_model))
        and not any(extra_next.values())
    )
    if stand_in_problem is not None and not all_done:
        raise stand_in_problem
    per_journal = {
        j: summarise_plan(campaign, [*cells, *extra_next[j]], finished[j]) for j in journals
    }
    # Each model runs its own cells left: the one with the most left sets the figures, the
    # twin's estimate among them (its cells left swept; none when nothing is left).
    most_left = max(per_journal, key=lambda j: per_journal[j].estimated_s, default=None)
    summary: PlanSummary = (
        per_journal[most_left] if most_left is not None else summarise_plan(campaign, cells, set())
    )
    done_there = frozenset(finished[most_left]) if most_left is not None else frozenset()
    knobs = campaign.knobs
    servers = tuple(server_plans(campaign, here=servers_here))
    recorded, method = "", ""
    corpora: dict[str, Corpus] | None = None
    try:
        # Counted as the sweep counts them: by the method of the journals it resumes (the
        # estimate stays the estimate though a tokenizer was cached since), else this machine's.
        recorded = "" if fresh else recorded_count_method(folder_journals(out_dir))
        corpora, method = counted_corpora(campaign, recorded)
        short = corpus_shortfalls(campaign, corpora)
        problems = [shortfall_line(campaign, short)] if short else []  # the sweep's line
        overrun = _twin_refusal(  # the sweep's line, exit 2 too
            lambda c: twin_context_overruns(c, corpora),
            campaign,
            twin,
            stand_in_too=estimate and stand_in_problem is None,
        )
        if overrun is None:  # an in-flight campaign's decodes the context cannot hold, as
            # the sweep refuses it
            overrun = _twin_refusal(
                lambda c: twin_inflight_overruns(c, corpora),
                campaign,
                twin,
                stand_in_too=estimate and stand_in_problem is None,
            )
        problems += [overrun] if overrun is not None else []
        codes = [2 for _ in problems]
    except (CorpusError, JournalError) as exc:  # exit code as the sweep's: 2 a bad file, 1 a
        # read fault or a journal's tokenizer this machine lacks
        problems, codes = [str(exc)], [exc.exit_code]
    # The journals it resumes, refused where their servers' environment or prompts changed
    # since (a corpus edited), as the sweep refuses them once it opens them.
    resume = [] if refused or fresh else resume_refusals(campaign, journals, corpora, method)
    codes += [exc.exit_code for exc in [*refusals, *resume]]
    problems += [*refused, *map(str, resume)]
    # Servers the twin engine would not start (weights too large for the GPUs), as SGLang
    # would not: each of their cells would fail, so refused here as an invalid campaign; on
    # the stand-in the estimate sweeps, an estimate of cells that all fail is none.
    unstartable = _twin_refusal(
        twin_start_refusal, campaign, twin, stand_in_too=estimate and stand_in_problem is None
    )
    if unstartable is not None:
        problems.append(unstartable)
        codes.append(2)
    sweeps = estimate and not problems and stand_in_problem is None and not all_done
    estimate_skipped = None
    if sweeps and len(cells) > MOST_ESTIMATED_CELLS:  # its sweep runs each of them in turn
        sweeps = False
        estimate_skipped = (
            f"the twin estimate sweeps each planned cell in turn, and {len(cells):,} cells"
            f"{f' in shard {shard.label}' if shard else ''} are more than it sweeps promptly "
            f"({MOST_ESTIMATED_CELLS:,} at most): the closed form's rough figure stands in"
        )
    twin_time = (
        twin_estimate(
            campaign,
            shard=shard,
            twin=twin,
            progress=progress,
            skip=done_there,
            count_method=recorded,
        )
        if sweeps
        else None
    )
    if twin_time is not None and twin_time.failed:
        # The estimate's sweep failed cells (an error the twin's server answered): the sweep
        # would fail them.
        on = "" if twin_stand_in(campaign, twin)[0] is campaign else " on its twin stand-in"
        problems.append(
            f"the twin's sweep of the campaign{on} failed {twin_time.failed} cell(s) (first: "
            f"{twin_time.first_failure}): the sweep would fail them as well; change what that "
            "error names before sweeping"
        )
        codes.append(2)
    cells_left = tuple(
        c
        for c in (cells if most_left is None else [*cells, *extra_next[most_left]])
        if c.key not in done_there
    )
    return DryRunPlan(
        campaign=campaign.name,
        hash=campaign.hash,
        gpu_backend=campaign.gpu.backend,
        gpu_profile=campaign.gpu.profile,
        gpu_devices=tuple(campaign.gpu.devices),
        actuation=campaign.gpu.actuation,
        grid={
            "sm_clock_mhz": list(knobs.sm_clocks_mhz) if knobs.sm_clocks_mhz else "stock",
            "power_limit_w": list(knobs.power_limits_w) if knobs.power_limits_w else "stock",
            "batch": list(campaign.workload.batch_sizes),
            "drafter": [d.name for d in campaign.drafters],
            "corpus": list(campaign.workload.corpus_names),
            "repeat": campaign.measurement.repeats,
        },
        cells=len(cells),
        already_done=already_done,
        server_starts=summary.server_starts,
        knob_changes=summary.knob_changes,
        comparison_groups=len({group_of(c) for c in cells}),
        cells_left=cells_left,
        estimated_s=summary.estimated_s,
        costs=(
            twin_time.costs
            if twin_time is not None and twin_time.costs is not None
            else RunCosts(
                {c.key: summary.per_cell_s for c in cells_left},
                start_s=summary.server_starts * summary.start_s,
                settle_s=summary.knob_changes * summary.settle_s,
            )
        ),
        most_left_folder=(
            most_left.parent.name if most_left is not None and most_left.parent != out_dir else None
        ),
        left_per_model={
            j.parent.name: len([c for c in [*cells, *extra_next[j]] if c.key not in finished[j]])
            for j in journals
            if j.parent != out_dir
        },
        servers=servers,
        problems=tuple(problems),
        shard=shard.label if shard else None,
        estimate=twin_time,
        estimate_skipped=estimate_skipped,
        done_per_model=done_per_model,
        left_for_other_models=left_for_other_models,
        max_repeats=campaign.measurement.max_repeats,
        precision=campaign.measurement.precision,
        extra_done=None if refused else sum(len(e) for e in extra_done.values()),
        extra_to_run=None if refused else sum(len(e) for e in extra_next.values()),
        fresh_moves=tuple(fresh_moves(out_dir)) if fresh else None,
        exit_code=max(codes, default=0),
    )


def spent_gpu_s(out_dir: Path, cube: xr.Dataset | None = None) -> float:
    """The GPU time a sweep into `out_dir` spent: its cells' `gpu_time_total_s` plus each
    session's overhead (counter detection, idle baseline, settle measurement), which the
    journal keeps on the session record. `cube`: the folder's cube, in memory (else read)."""
    from dvfs.cube import open_cube
    from dvfs.measure.journal import iter_records

    ds = open_cube(out_dir / CUBE_NAME) if cube is None else cube
    cells = float(ds["gpu_time_total_s"].fillna(0.0).sum())
    sessions = sum(
        float((r.get("gpu_time_s") or {}).get("total", 0.0))
        for r in iter_records(out_dir / JOURNAL_NAME)
        if r.get("type") == "session"
    )
    return cells + sessions


def twin_gpu_s(campaign: Campaign, *, shard: Shard | None = None) -> float | None:
    """The GPU time the twin spends on the campaign (or shard): every cell swept into a
    temporary folder in virtual time. None unless both the GPU and the engine are the twin."""
    if campaign.gpu.backend != "twin" or campaign.engine.backend != "twin":
        return None
    return twin_estimate(campaign, shard=shard).dvfs_gpu_s


def _words(text: str) -> set[str]:
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if w}


def stand_in_profile(campaign: Campaign, twin: str | None = None) -> tuple[str, str]:
    """The twin GPU profile that stands in for the campaign's GPU: `twin` when given, else the
    campaign's `gpu.profile`, else the one profile whose key's words (h100, sxm) all appear in
    the campaign's name or description; and where it came from. One clear line when none (or
    several) match."""
    from dvfs.twin.profiles import gpu_profile, gpu_profiles

    known = ", ".join(sorted(gpu_profiles()))
    chosen = twin or campaign.gpu.profile
    if chosen:
        gpu_profile(chosen)  # an unknown profile (or trap list) is one line
        return chosen, "--twin" if twin else "gpu.profile"
    said = _words(f"{campaign.name} {campaign.description}")
    matches = [key for key in sorted(gpu_profiles()) if _words(key) <= said]
    if len(matches) != 1:
        what = f"several twin GPUs ({', '.join(matches)})" if matches else "no twin GPU"
        raise CampaignError(
            f"campaign {campaign.name!r} names {what} in its name or description, so no twin "
            f"stands in for its GPU to estimate its GPU time: name one with --twin PROFILE "
            f"({known}), or pass --no-estimate"
        )
    return matches[0], "named in the campaign's name or description"


def _twin_refusal(
    refusal: Callable[[Campaign], str | None],
    campaign: Campaign,
    twin: str | None,
    *,
    stand_in_too: bool,
) -> str | None:
    """What `refusal` (a twin limit's check) says of the campaign; where it says nothing and
    the dry run's estimate sweeps a twin stand-in (`stand_in_too`), what it says of that
    stand-in, as such: the estimate's sweep of it would be refused in that line."""
    found = refusal(campaign)
    if found is not None or not stand_in_too:
        return found
    stand_in, stand_in_key, _ = twin_stand_in(campaign, twin)
    there = None if stand_in is campaign else refusal(stand_in)
    return None if there is None else f"on the twin stand-in {stand_in_key}: {there}"


def twin_stand_in(
    campaign: Campaign, twin: str | None = None, *, profile_digest: str = ""
) -> tuple[Campaign, str, str]:
    """The campaign with its GPU and engine backends switched to the twin (the profile from
    `stand_in_profile`, the model from the engine's `twin_model` or `model`), that profile and
    where it came from. A twin campaign is its own stand-in (unless `twin` names another
    profile). `profile_digest` (`dvfs.twin.fit.profile_digest`) binds a profile lent from a
    file to the journal: its key alone does not say its figures."""
    if campaign.gpu.backend == "twin" and campaign.engine.backend == "twin" and twin is None:
        return campaign, campaign.gpu.profile or "", "the campaign's own"
    profile, source = stand_in_profile(campaign, twin)
    from dvfs.twin.profiles import model_profile

    model_profile(campaign.engine.simulated_model)  # one line if unknown
    devices = campaign.gpu.devices
    twin_devices: tuple[int | str, ...] = (
        devices if all(isinstance(d, int) for d in devices) else tuple(range(len(devices)))
    )
    groups = campaign.gpu.groups
    if groups:
        size = len(groups[0])
        groups = tuple(twin_devices[i : i + size] for i in range(0, len(twin_devices), size))
    gpu = dataclasses.replace(
        campaign.gpu,
        backend="twin",
        profile=profile,
        devices=twin_devices,
        groups=groups,
        profile_digest=profile_digest,
    )
    engine = dataclasses.replace(campaign.engine, backend="twin")
    return dataclasses.replace(campaign, gpu=gpu, engine=engine), profile, source


#: The naive protocol the dry run and `tests/bench/bench_protocol.py` compare against: every
#: cell starts its server, waits a fixed settle (`knobs.settle_s`), warms up, prefills and
#: measures one fixed 5 s window, and is repeated a fixed 3 times.
NAIVE_WINDOW_S = 5.0


NAIVE_REPEATS = 3


@dataclass(frozen=True)
class TwinEstimate:
    """GPU time on the twin stand-in: what dvfs's protocol spends (swept), what the naive
    protocol would (derived per cell from the sweep, `naive_gpu_s`), and the window share."""

    profile: str
    #: Where the profile came from: "--twin", "gpu.profile", the campaign's text, its own.
    source: str
    dvfs_gpu_s: float
    window_s: float
    naive_gpu_s: float
    cells: int
    #: The planned cells left out as already done in the folder planned for (0: all swept).
    skipped: int = 0
    #: The cells its sweep failed (after their retries), and the first one's label and last
    #: error: the sweep of the campaign would fail them too.
    failed: int = 0
    first_failure: str = ""
    #: Its sweep split as a fleet's workers spend it (`dvfs.estimate.RunCosts`): each cell's
    #: own time, and what every worker spends again (starts, settles, idle baselines, session).
    costs: RunCosts | None = None


def naive_gpu_s(ds: Any, campaign: Campaign, *, attached: bool = False) -> float:
    """The naive protocol's GPU time on the cells of a swept cube, from what the twin measured
    in each: per cell, `NAIVE_REPEATS` times one server start (the twin's, as
    `gpu_time_server_start_s` records it), the campaign's fixed `knobs.settle_s`, a warm-up of
    `warmup_tokens` at the cell's time per token (batch / throughput), the median time to first
    token and a fixed `NAIVE_WINDOW_S` window. Each of the campaign's `repeats` measured
    repeats of a cell carries its share of the naive cell (so a shard counts its slice);
    repeats added by adaptive precision, and cells the twin did not measure, count nothing.
    `attached`: the campaign attaches to a running server (engine.sglang.url), which the
    naive protocol does not start either."""
    import numpy as np

    start = float(np.nanmax(ds["gpu_time_server_start_s"].values, initial=0.0))
    if attached:
        start = 0.0
    elif start <= 0:
        from dvfs.engines.twin import STARTUP_S

        start = STARTUP_S
    repeats = campaign.measurement.repeats
    ds = ds.isel(repeat=ds["repeat"].values < repeats)
    per_token = ds["batch"] / ds["throughput_tok_s"]
    ttft = ds["ttft_ms"].sel(quantile=0.5, method="nearest") / 1000
    warm = campaign.measurement.warmup_tokens * per_token
    once = (start + campaign.knobs.settle_s + warm + ttft + NAIVE_WINDOW_S).values
    return float(NAIVE_REPEATS / repeats * np.nansum(once[np.isfinite(once)]))


def twin_estimate(
    campaign: Campaign,
    *,
    shard: Shard | None = None,
    twin: str | None = None,
    progress: Progress | None = None,
    skip: Collection[str] = (),
    count_method: str = "",
) -> TwinEstimate:
    """Sweep the campaign's twin stand-in (`twin_stand_in`) into a temporary folder, in
    virtual time, and read off the GPU time it spends and the naive protocol's. `skip`: keys
    of the cells already done in the folder planned for: swept first, in a sweep of their own
    (not counted), so that the sweep after them resumes as the sweep there would, on the cells
    left and the extra repeats every group then asks for (its own or the done cells' groups,
    with max_repeats); the estimate is of that resumed sweep. `count_method`: the token-count
    method of the journal the estimate is for, which its sweep would keep."""
    import tempfile

    from dvfs.corpora.tokens import TOKENIZER_OF
    from dvfs.cube import open_cube

    stand_in, profile, source = twin_stand_in(campaign, twin)
    if len(stand_in.gpu.groups) > 1:
        from dvfs.fleet.devices import for_group

        # Each cell runs on one group's server, as a fleet's worker runs it: not on one server
        # spanning every group's GPUs (a wider tensor-parallel server, faster than the sweep's).
        stand_in = for_group(stand_in, stand_in.gpu.groups[0])
    if count_method.startswith(TOKENIZER_OF) and count_method != (
        f"{TOKENIZER_OF}{tokenizer_model(stand_in)}"
    ):
        # The tokenizer of the campaign's own model (a local path, say), which the stand-in,
        # naming its model by the twin's profile, cannot count by: counted as a new sweep of
        # the stand-in counts (its profile's tokenizer where cached, else the estimate), not
        # refused as a journal whose tokenizer this machine lacks.
        count_method = ""
    skipped = len([c for c in planned_cells(campaign, shard) if c.key in skip]) if skip else 0
    with tempfile.TemporaryDirectory(prefix="dvfs-dry-run-") as tmp:
        out = Path(tmp)
        before: xr.Dataset | None = None
        if skip:
            before = run_sweep(
                stand_in, out, shard=shard, only=skip, count_method=count_method
            ).cube
            if before is None:
                before = open_cube(out / CUBE_NAME)
            already = spent_gpu_s(out, before)
        # The cube the sweep holds in memory: the numbers of the file it wrote, without
        # reading the file back (twice, before).
        swept = run_sweep(stand_in, out, shard=shard, progress=progress, count_method=count_method)
        failed, first_failure = swept.summary.failed, ""
        if failed:
            first_failure = _first_failure(swept.journal_path)
        ds = swept.cube
        if ds is None:
            ds = open_cube(out / CUBE_NAME)
        spent = spent_gpu_s(out, ds)
        if before is not None:  # what the resumed sweep spent: the cells it measured alone
            spent -= already
            earlier = before["gpu_time_total_s"].notnull()
            ds = ds.where(~earlier.reindex_like(ds["gpu_time_total_s"], fill_value=False))
        window = float(ds["gpu_time_window_s"].fillna(0.0).sum())
        # An attached server (engine.sglang.url) is running already: the stand-in's server
        # starts are not spent (the thermal stabilisation after each attach still is).
        attached = campaign.engine.backend == "sglang" and bool(campaign.engine.sglang.url)
        if attached and "gpu_time_server_start_s" in ds:
            launching = float(ds["gpu_time_server_start_s"].fillna(0.0).sum())
            spent -= launching
        naive = naive_gpu_s(ds, stand_in, attached=attached)
        cells = int(ds["gpu_time_total_s"].notnull().sum())
        costs = _run_costs(swept.journal_path, attached=attached)
    return TwinEstimate(
        profile, source, spent, window, naive, cells, skipped, failed, first_failure, costs
    )


#: The parts of a cell's GPU time that a fleet's every worker spends again on its own GPU
#: (`dvfs.estimate`): a server start, the stabilisation after it, a knob change's settle, a
#: setting's idle baseline. The rest is the cell's own.
_WORKER_PARTS = ("server_start", "stabilise", "settle", "idle_baseline")


def _run_costs(journal: Path, *, attached: bool = False) -> RunCosts:
    """The last session of `journal` (a sweep's, resumed or not) split as `RunCosts`: each
    cell's own GPU time, its starts (none spent launching when `attached`), settles, idle
    baselines and the session's overhead."""
    from dvfs.measure.journal import iter_records
    from dvfs.measure.plan import Cell

    records = list(iter_records(journal))
    last = max((i for i, r in enumerate(records) if r.get("type") == "session"), default=0)
    session_s = float(((records[last] if records else {}).get("gpu_time_s") or {}).get("total", 0))
    cell_s: dict[str, float] = {}
    parts = dict.fromkeys(_WORKER_PARTS, 0.0)
    made = dict.fromkeys(("starts", "changes", "settings"), 0)
    for record in records[last:]:
        if record.get("type") != "cell":
            continue
        time = {k: float(v) for k, v in (record.get("gpu_time_s") or {}).items()}
        key = Cell.from_dict(record["cell"]).key
        own = sum(v for k, v in time.items() if k not in parts and k != "total")
        cell_s[key] = cell_s.get(key, 0.0) + own
        for name in parts:
            parts[name] += time.get(name, 0.0)
        made["starts"] += time.get("server_start", 0.0) + time.get("stabilise", 0.0) > 0
        made["changes"] += time.get("settle", 0.0) > 0
        made["settings"] += time.get("idle_baseline", 0.0) > 0
    if attached:  # an attached server is running already: no start is spent launching it
        parts["server_start"] = 0.0
    return RunCosts(
        cell_s=cell_s,
        start_s=parts["server_start"] + parts["stabilise"],
        settle_s=parts["settle"],
        idle_s=parts["idle_baseline"],
        session_s=session_s,
        **made,
    )


def _first_failure(journal: Path) -> str:
    """The first failed cell of `journal` as "<cell>: <its last error's first line>"."""
    from dvfs.measure.journal import iter_records
    from dvfs.measure.plan import Cell, cell_label

    for record in iter_records(journal):
        if record.get("type") != "cell" or record.get("status") == "ok":
            continue
        errors = record.get("errors") or [record.get("error") or ""]
        if errors[-1]:
            return f"{cell_label(Cell.from_dict(record['cell']))}: {errors[-1].splitlines()[0]}"
    return ""
