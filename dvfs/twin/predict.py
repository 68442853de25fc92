"""What the twin's physics predicts for each cell of a sweep cube, deterministically.

`dvfs twin fit CUBE` (`dvfs.twin.fitcube`) compares these predictions with the measured cells.
The model is the twin's own, not a second one: each cell's steady-state window (a fixed batch,
from the last first token to the first finish) becomes the decode passes the twin engine
builds (`dvfs.twin.passes.decode_passes`, with `dvfs.twin.drafting.plan_drafter`'s draft plan),
with the expected acceptance in place of random draws, and they are timed and powered by
`dvfs.twin.physics.operating_point` at the cell's SM clock and power limit. No noise, no NVML
traps, no settling: what a measurement would read with perfect instruments.

A cell's figures are over the windows of all its rounds (`rounds`: energies, times and tokens
summed), and each round sends other prompts (sampled by the round's index), so each window
reads another context: a cell is predicted over its rounds' prompts as one representative
window whose context sum and KV bytes at each iteration are the rounds' mean (the passes'
FLOPs and bytes are linear in them, but for a windowed model's drafts, and the rounds' windows
are alike in every other way here): within 0.03% of timing every round's window on the demo's
cells, at the cost of one.
The first round's prompts alone missed the cell's context by an error shared by every cell
of its group, which the fit took up: `verify_attention_efficiency` came back 0.565 +- 0.0075
for 0.5 on the demo campaign's cube without traps (0.5085 +- 0.005 over every round).

The passes do not depend on the GPU's figures, so they are counted once per cube
(`CubeCells`) and only timed for each profile the fit tries (`predict`): at each clock only
the passes of the cells measured there, then one operating point per knob setting.

Tokens per verify pass come from the cube where it recorded them (`accept_length`, the pool
over every request, less its prefill token: x (T - 1) / T for requests of T tokens, exact when
they ran to length; the mean over the knob settings whose cells took as many rounds, which
sent the same prompts: acceptance is a property of the text and the drafter, not of the GPU),
else from the twin's expected acceptance on the corpus's text. Not `server_accept_length`:
SGLang leaves each round's last partial block of decode iterations out of it, and has none
for rounds shorter than a block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.errors import (
    CampaignError,
    CorpusError,
    CorpusUnavailableError,
    DvfsError,
    JournalError,
)
from dvfs.twin import physics
from dvfs.twin.drafting import DraftPlan, plan_drafter
from dvfs.twin.passes import PassBuilder, decode_passes
from dvfs.twin.physics import Passes
from dvfs.twin.profiles import GpuProfile, ModelProfile

if TYPE_CHECKING:
    import xarray as xr


#: The observables predicted per cell, all over the steady-state windows: energy per output
#: token, time per output token of one request (the window's length over its tokens per
#: request: `decode_time_s` x batch / `output_tokens`, not a median, so acceptance's spread
#: between requests does not bias it), and mean power.
OBSERVABLES = ("energy_per_token_j", "time_per_token_ms", "power_mean_w")
#: The cube variables the fit reads.
NEEDED = ("valid", "energy_per_token_j", "decode_time_s", "output_tokens", "power_mean_w")


class PredictError(DvfsError):
    """The cube cannot be predicted cell by cell (closed-loop, unknown model, no campaign)."""

    exit_code = 2


class PredictUnavailableError(PredictError):
    """This machine lacks what re-reading the cube's prompts needs, though the cube may be
    fine: the tokenizer its sweep counted with, no longer cached, or a corpus's library or hub
    (`CorpusUnavailableError`). An error, not bad input (exit 1), as a resumed sweep says it."""

    exit_code = 1


@dataclass(frozen=True)
class Setting:
    """A knob setting of the cells, with what no GPU figure changes: the cells measured there,
    the passes of their groups (indices into its `Clock`'s passes, ascending) and their
    groups."""

    clock_mhz: int
    limit_w: float
    cells: np.ndarray
    take: np.ndarray | None  # None: every pass of its clock
    passes: Passes
    pass_group: np.ndarray


@dataclass(frozen=True)
class Clock:
    """An SM clock of the cells: the passes of the groups measured there (at any power limit),
    timed once per profile, and its knob settings."""

    clock_mhz: int
    passes: Passes
    settings: tuple[Setting, ...]


@dataclass(frozen=True)
class CubeCells:
    """The cells of a cube the twin predicts, with their passes counted once.

    Cells are flat arrays (one entry per cell). A group is a (batch, drafter, corpus, repeat,
    rounds) whose passes every knob setting shares (the rounds' representative window:
    `window_passes`); `passes` holds every group's window passes end to end, `pass_group` the
    group of each pass."""

    labels: tuple[str, ...]
    sm_clock_mhz: np.ndarray
    power_limit_w: np.ndarray
    group: np.ndarray
    passes: Passes
    pass_group: np.ndarray
    #: Per group: output tokens in the window, and per request (the batch's mean).
    group_tokens: np.ndarray
    group_request_tokens: np.ndarray
    #: The measured value of each observable per cell (NaN where not measured).
    measured: dict[str, np.ndarray]
    #: The mean SM clock sampled in each cell's window (NaN where not recorded).
    observed_clock_mhz: np.ndarray
    notes: tuple[str, ...] = ()
    #: The GPUs of the server (`engine.tp_size`): a cell's energy and power are its GPUs'
    #: sum, while the passes are one GPU's share of the work (`PassBuilder`), each GPU
    #: drawing alike under its own power limit.
    gpus: int = 1

    def __len__(self) -> int:
        return len(self.labels)

    @functools.cached_property
    def clocks(self) -> tuple[Clock, ...]:
        """The clocks and knob settings of the cells, worked out once (a fit predicts the same
        cells hundreds of times): a clock's passes are those of the groups measured there, so
        a group is timed only at the clocks it has cells at."""
        n_groups = len(self.group_tokens)
        found = []
        for clock in np.unique(self.sm_clock_mhz):
            at_clock = self.sm_clock_mhz == clock
            wanted = np.zeros(n_groups, dtype=bool)
            wanted[self.group[at_clock]] = True
            take = np.flatnonzero(wanted[self.pass_group])
            every = len(take) == len(self.passes)
            passes = self.passes if every else self.passes.take(take)
            pass_group = self.pass_group if every else self.pass_group[take]
            settings = []
            for limit in np.unique(self.power_limit_w[at_clock]):
                at = np.flatnonzero(at_clock & (self.power_limit_w == limit))
                wanted = np.zeros(n_groups, dtype=bool)
                wanted[self.group[at]] = True
                own = np.flatnonzero(wanted[pass_group])
                all_of_clock = len(own) == len(passes)
                settings.append(
                    Setting(
                        int(clock),
                        float(limit),
                        at,
                        None if all_of_clock else own,
                        passes if all_of_clock else passes.take(own),
                        pass_group if all_of_clock else pass_group[own],
                    )
                )
            found.append(Clock(int(clock), passes, tuple(settings)))
        return tuple(found)

    def subset(self, keep: np.ndarray) -> CubeCells:
        """The cells where `keep` is true (their groups' passes are kept whole)."""
        return dataclasses.replace(
            self,
            labels=tuple(label for label, k in zip(self.labels, keep, strict=True) if k),
            sm_clock_mhz=self.sm_clock_mhz[keep],
            power_limit_w=self.power_limit_w[keep],
            group=self.group[keep],
            measured={name: values[keep] for name, values in self.measured.items()},
            observed_clock_mhz=self.observed_clock_mhz[keep],
        )


@dataclass(frozen=True)
class Prediction:
    """Each observable per cell (`OBSERVABLES`), and whether the power limit throttled it."""

    values: dict[str, np.ndarray]
    capped: np.ndarray


def window_passes(
    model: ModelProfile,
    plan: DraftPlan | None,
    tp_size: int,
    lengths: np.ndarray,
    output_tokens: int,
    tokens_per_verify: float,
) -> tuple[Passes, float]:
    """The decode passes of a fixed batch's steady window with `tokens_per_verify` tokens per
    request per iteration (no draws: every request advances alike), and the output tokens in
    the window. Built as the twin engine's `_plan_fixed` builds its full-batch decode.

    `lengths`: the batch's prompt lengths, or one row of them per round (rounds x batch): the
    rounds' representative window, whose context sum and KV bytes read at each iteration are
    the rounds' mean (every round's window has the same iterations here)."""
    rounds = np.atleast_2d(np.asarray(lengths))
    batch = rounds.shape[1]
    remaining = output_tokens - 1  # the first token comes from the prefill
    length = max(1.0, float(tokens_per_verify))
    n_iter = max(1, math.floor(remaining / length))
    before = length * np.arange(n_iter, dtype=float)  # tokens each request had before
    context = rounds[:, :, None].astype(float) + 1.0 + before[None, None, :]
    active = np.full(n_iter, float(batch))
    ctx_sum = context.sum(axis=1).mean(axis=0)
    ctx_kv = np.asarray(model.kv_bytes_read(context), dtype=float).sum(axis=1).mean(axis=0)
    emitted = np.full(n_iter, batch * length)
    builder = PassBuilder(tp_size)
    decode_passes(builder, model, plan, active, ctx_sum, ctx_kv, ctx_sum / batch, emitted)
    return builder.parts[-1], float(n_iter * batch * length)


def _measured(ds: xr.Dataset) -> dict[str, xr.DataArray]:
    """Each observable per cell as the cube records it."""
    per_request = ds["output_tokens"] / ds["batch"]
    return {
        "energy_per_token_j": ds["energy_per_token_j"],
        "time_per_token_ms": ds["decode_time_s"] / per_request.where(per_request > 0) * 1e3,
        "power_mean_w": ds["power_mean_w"],
    }


def cube_cells(
    ds: xr.Dataset, where: Path, *, max_cells: int | None = None, seed: int = 0
) -> CubeCells:
    """The valid cells of a fixed-batch cube and their window passes. With `max_cells`, a
    subsample of that many cells (chosen at random with `seed`, every group kept where it can
    be), said in `notes`."""
    from dvfs.backends import corpus_texts, tokenizer_model
    from dvfs.corpora.prepare import counted_corpora
    from dvfs.corpora.sampling import sample_prompts
    from dvfs.corpora.tokens import download_hint
    from dvfs.cube.knobs import swept_knobs
    from dvfs.cube.prompts import campaign_of, check_same_corpora
    from dvfs.twin.profiles import model_profile

    if "gpu" in ds.dims:
        raise PredictError(
            f"{where} is a merged cube of {ds.sizes['gpu']} GPUs: fit each GPU's own cube"
        )
    missing = [v for v in NEEDED if v not in ds.data_vars]
    if missing:
        raise PredictError(f"{where} lacks variable(s) {', '.join(missing)} the fit needs")
    campaign = campaign_of(ds, where)
    w = campaign.workload
    if w.mode != "fixed":
        raise PredictError(
            f"{where} was measured in {w.mode} mode; the cube fit predicts fixed-batch cells only"
        )
    if campaign.measurement.mode == "in-flight":
        # Its cells are knob levels stepped inside shared decodes, each carried back to a
        # per-level cell's context along a drift fit: not the steady windows predicted here.
        raise PredictError(
            f"{where} was measured in-flight (knob levels stepped inside shared decodes); the "
            'cube fit predicts per-level cells only: sweep with measurement.mode = "per-level"'
        )
    try:
        model = model_profile(campaign.engine.simulated_model)
    except CampaignError as exc:
        raise PredictError(f"{where}: {exc}") from exc
    method = str(ds.attrs.get("token_count_method") or "")
    try:
        corpora, _ = counted_corpora(campaign, method)
    except CorpusUnavailableError as exc:
        raise PredictUnavailableError(
            f"{where}: the prompts of its cells cannot be read again here: {exc}"
        ) from exc
    except CorpusError as exc:
        raise PredictError(
            f"{where}: the prompts of its cells cannot be read again: {exc}; the fit re-reads "
            "the corpora its sweep read: put them back where they were"
        ) from exc
    except JournalError as exc:  # its tokenizer is no longer in the local cache
        tokenizer = tokenizer_model(campaign) or ""
        raise PredictUnavailableError(
            f"{where} chose its prompts by the {method}, which is not in the local cache: "
            f"download it ({download_hint(tokenizer)}) and fit again"
        ) from exc
    check_same_corpora(ds, where, corpora, w.input_tokens)
    texts = corpus_texts(campaign, corpora)
    drafters = {d.name: d for d in campaign.drafters}
    measured = _measured(ds)
    dims = ("sm_clock", "power_limit", "batch", "drafter", "corpus", "repeat")
    ok = (ds["valid"] == 1).transpose(*dims).values
    if "cell_status" in ds:
        from dvfs.cube.schema import STATUS_OK

        ok &= (ds["cell_status"] == STATUS_OK).transpose(*dims).values
    ok &= np.isfinite(measured["energy_per_token_j"].transpose(*dims).values)
    index = np.argwhere(ok)
    notes: list[str] = []
    if max_cells is not None and len(index) > max_cells:
        pick = np.sort(np.random.default_rng(seed).choice(len(index), max_cells, replace=False))
        notes.append(f"fitted on {max_cells} of {len(index)} valid cells, chosen at random")
        index = index[pick]
    if len(index) == 0:
        raise PredictError(f"{where} has no valid measured cell to fit")
    accept = ds.get("accept_length")
    coords = {d: ds[d].values for d in dims}
    labels = [str(v) for v in ds["drafter"].values]
    corpora_names = [str(v) for v in ds["corpus"].values]

    def flat(values: xr.DataArray) -> np.ndarray:
        grid = values.transpose(*dims).values.astype(float)
        return grid[tuple(index.T)]

    # Each cell's rounds (its figures are over all their windows), each round its own prompts
    rounds_grid = ds.get("rounds")
    if rounds_grid is not None:
        seen_rounds = flat(rounds_grid)
        cell_rounds = np.where(np.isfinite(seen_rounds) & (seen_rounds >= 1), seen_rounds, 1)
    else:
        notes.append("the cube records no rounds per cell: each is predicted on its first round")
        cell_rounds = np.ones(len(index))
    round_lengths: dict[tuple[int, int, int, int], np.ndarray] = {}

    def prompt_lengths(batch: int, corpus: str, repeat: int, label: int) -> np.ndarray:
        """The input tokens of the prompts a round sent (as `Runner._prompts_for` samples
        them: by batch, repeat and the round's index)."""
        key = (batch, corpora_names.index(corpus), repeat, label)
        if key not in round_lengths:
            prompts = sample_prompts(
                corpora[corpus],
                batch,
                input_tokens=w.input_tokens,
                seed=campaign.measurement.seed,
                key=(batch, repeat, label),
            )
            round_lengths[key] = np.array([p.input_tokens for p in prompts], dtype=np.int64)
        return round_lengths[key]

    groups: dict[tuple[int, int, int, int, int], int] = {}
    parts: list[Passes] = []
    pass_group: list[np.ndarray] = []
    tokens: list[float] = []
    request_tokens: list[float] = []
    plans: dict[str, DraftPlan | None] = {}
    cell_group = np.empty(len(index), dtype=np.int64)
    for i, (_, _, b, d, c, r) in enumerate(index):
        n_rounds = int(cell_rounds[i])
        key = (int(b), int(d), int(c), int(r), n_rounds)
        if key not in groups:
            drafter_name, corpus = labels[d], corpora_names[c]
            if drafter_name not in drafters:
                raise PredictError(f"{where}: drafter {drafter_name!r} is not in its campaign")
            if drafter_name not in plans:
                plans[drafter_name] = plan_drafter(drafters[drafter_name], model)
            plan = plans[drafter_name]
            batch = int(coords["batch"][b])
            length = 1.0
            if plan is not None:
                seen = _accept_length(accept, rounds_grid, (b, d, c, r), n_rounds)
                text = texts.get(corpus)
                if math.isfinite(seen):
                    length = seen * (w.output_tokens - 1) / w.output_tokens
                elif text is not None:
                    length = plan.expected_accept_length(text, w.temperature)
                else:
                    length = plan.expected_accept_length(corpus, w.temperature)
            repeat = int(coords["repeat"][r])
            lengths = np.stack([prompt_lengths(batch, corpus, repeat, k) for k in range(n_rounds)])
            passes, n_tokens = window_passes(
                model,
                plan,
                campaign.engine.tp_size,
                lengths,
                w.output_tokens,
                length,
            )
            groups[key] = len(parts)
            parts.append(passes)
            pass_group.append(np.full(len(passes), groups[key]))
            tokens.append(n_tokens)
            request_tokens.append(n_tokens / batch)
        cell_group[i] = groups[key]
    # a knob the campaign never set reads "not set", as every analysis says it, not the stock
    # value its cells are filed under (a power-limit-only cube's SM clock is no lock)
    clock_set, limit_set = swept_knobs(ds)
    unset = {d for d, s in (("sm_clock", clock_set), ("power_limit", limit_set)) if not s}
    names = [
        " ".join(
            f"{d}={'not set' if d in unset else _label(ds, d, int(j))}"
            for d, j in zip(dims, row, strict=True)
        )
        for row in index
    ]
    return CubeCells(
        labels=tuple(names),
        sm_clock_mhz=coords["sm_clock"][index[:, 0]].astype(float),
        power_limit_w=coords["power_limit"][index[:, 1]].astype(float),
        group=cell_group,
        passes=Passes.concat(parts),
        pass_group=np.concatenate(pass_group),
        group_tokens=np.array(tokens),
        group_request_tokens=np.array(request_tokens),
        measured={name: flat(values) for name, values in measured.items()},
        observed_clock_mhz=(
            flat(ds["sm_clock_observed_mhz"])
            if "sm_clock_observed_mhz" in ds
            else np.full(len(index), np.nan)
        ),
        notes=tuple(notes),
        gpus=campaign.engine.tp_size,
    )


def _accept_length(
    accept: xr.DataArray | None,
    rounds: xr.DataArray | None,
    group: tuple[int, int, int, int],
    n_rounds: int,
) -> float:
    """The group's (batch, drafter, corpus, repeat: indices) accept length over its knob
    settings (acceptance is the text's and the drafter's, not the GPU's), from its cells of
    `n_rounds` rounds where any recorded one (they sent the same prompts), else from all; NaN
    where none is recorded."""
    if accept is None:
        return math.nan
    b, d, c, r = group
    seen = accept.isel(batch=b, drafter=d, corpus=c, repeat=r)
    if rounds is not None:
        alike = seen.where(rounds.isel(batch=b, drafter=d, corpus=c, repeat=r) == n_rounds)
        if bool(np.isfinite(alike).any()):
            seen = alike
    return float(seen.mean(skipna=True))


def _label(ds: xr.Dataset, dim: str, i: int) -> Any:
    value = ds[dim].values[i]
    if isinstance(value, np.generic):
        value = value.item()
    return f"{value:g}" if isinstance(value, float) else value


def predict(gpu: GpuProfile, cells: CubeCells) -> Prediction:
    """Each cell's observables on `gpu`: one `physics.operating_point` per knob setting over
    the passes of every group measured there (the limit holds pass by pass, as the twin's).

    The passes of the groups measured at a clock are timed once there (`physics.time_passes`
    is elementwise: a setting's passes read their share), so two power limits at one clock
    cost one timing and the search of the passes over the lower limit. Energy and power are
    the server's, as a cube records them: its `gpus` (tensor-parallel) each run the passes,
    under the power limit each GPU has."""
    n_groups = len(cells.group_tokens)
    energy = np.zeros(len(cells))
    seconds = np.zeros(len(cells))
    capped = np.zeros(len(cells), dtype=bool)
    for clock in cells.clocks:
        whole = physics.time_passes(gpu, clock.passes, clock.clock_mhz)
        for s in clock.settings:
            timing = whole if s.take is None else _take(whole, s.take)
            duration_s, power_w = timing.duration_s, timing.power_w
            over = np.flatnonzero(power_w > s.limit_w)
            groups = cells.group[s.cells]
            if len(over):
                # Only the passes over the limit are searched and timed again: the others
                # keep the requested clock, as `operating_point` keeps them.
                hot = physics.operating_point(
                    gpu, s.passes.take(over), s.clock_mhz, s.limit_w, _take(timing, over)
                ).timing
                duration_s, power_w = duration_s.copy(), power_w.copy()
                duration_s[over], power_w[over] = hot.duration_s, hot.power_w
                slowed = np.bincount(
                    s.pass_group[over],
                    weights=(hot.pass_clocks_mhz < s.clock_mhz).astype(float),
                    minlength=n_groups,
                )
                capped[s.cells] = slowed[groups] > 0
            e_group = np.bincount(s.pass_group, weights=duration_s * power_w, minlength=n_groups)
            s_group = np.bincount(s.pass_group, weights=duration_s, minlength=n_groups)
            energy[s.cells] = e_group[groups]
            seconds[s.cells] = s_group[groups]
    energy = energy * cells.gpus  # the server's: each of its GPUs runs these passes
    tokens = cells.group_tokens[cells.group]
    per_request = cells.group_request_tokens[cells.group]
    values = {
        "energy_per_token_j": energy / tokens,
        "time_per_token_ms": seconds / per_request * 1e3,
        "power_mean_w": energy / np.maximum(seconds, 1e-30),
    }
    return Prediction(values, capped)


def _take(timing: physics.PassTiming, take: np.ndarray) -> physics.PassTiming:
    """The timing of the passes at `take` (of a timing at one clock)."""
    return physics.PassTiming(
        timing.sm_clock_mhz,
        timing.duration_s[take],
        timing.power_w[take],
        timing.tensor_util[take],
        timing.memory_util[take],
    )
