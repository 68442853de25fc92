"""Where the energy goes: the split of each cell's energy into prefill, drafting, verification
and overhead, exact where the cube has it (the twin) and estimated where it does not.

A real GPU's energy counter sees a whole decode iteration; nothing in SGLang meters its draft
passes apart from its verify pass. `estimate_split` estimates the drafting share from how the
energy of one decode iteration changes with the drafter's settings, across a *family* of cells
that differ only in those settings: the same knob setting, batch, corpus and repeat, and
drafters of one algorithm, draft model and top-k that differ in `num_steps` (the drafters
without speculation join every family as its zero-draft anchor). Per family, least squares on

    E_iter = c0 + c_draft x n_draft + c_verify x k

with E_iter a cell's energy per decode iteration (`energy_j` over `window_tokens / (batch x
accept_length)` iterations), n_draft its draft passes per iteration (`num_steps` draft steps
plus the draft-extend pass of EAGLE-style drafters: every pass of a small draft model costs
about the same, its weights and the KV cache it reads, whatever its handful of tokens per
request) and k the tokens each request verifies (`num_draft_tokens`; 1 without speculation).
A cell's drafting energy is then N_iter x c_draft x n_draft, and the rest of its energy is
verification and overhead together (host overhead rides on every pass, so the two are not
separable from the counter). Time is estimated the same way from `decode_time_s`.

Assumptions, which the twin checks (`tests/test_energy_split.py`): each draft pass costs the
same, at the marginal step's price (a first step with one token per request and the
draft-extend cost less than later steps with top-k tokens, so drafting is overstated); the
verify pass grows linearly in its tokens between the anchor's one and the drafters' k (true
while it stays on one side of the ridge point); the windows' iterations all run the full
batch (the steady window of a fixed batch). A fitted c_verify below zero (the anchor's
iteration lacks the drafter's fixed costs) is dropped and the fit redone without it; so is
one the design cannot tell from c_draft (no anchor, and k moving with n as in top-k 1
chains, where the verify pass's growth is then counted as drafting). N-gram (drafting on the
host), single-pass block drafters (DFLASH) and families whose verified tokens move in step
with their draft passes (top-k 1 chains, below) get no estimate.

Measured on the twin (h100-sxm without traps, Llama-3.1-8B, EAGLE-3 top-k 4 with 2, 3 and 5
steps): the drafting time within 2% of the exact split; the drafting energy overstated by 5-7%
at batch 1, 19-27% at batch 8 and 22-42% at batch 32: 1-4% of the cell's energy. A top-k 1
family (k = steps + 1) leans on its anchor for c_verify, whose plain decode lacks the
speculative step's fixed costs (its fitted c_verify falls below zero, or comes out too small):
the drafting energy came out 1.4x the exact at batch 1, 2.2x at 8 and 3.3x at 32 (time
1.8-3.4x), so such a family gets no estimate.

The prefill share of the windows: a fixed batch's steady window starts after its last prefill
(none inside); in closed-loop mode prefill chunks ride inside decode iterations and the
estimate counts them as verification and overhead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.headroom import reference_setting, ruled_out_settings, valid_mask
from dvfs.engines.base import SPLIT_PARTS
from dvfs.errors import AnalysisError
from dvfs.records.cell import SPLIT_METHODS

if TYPE_CHECKING:
    import xarray as xr

#: Drafters whose draft model also runs a draft-extend pass after the verify pass (SGLang's
#: EAGLE worker and the standalone worker built on it).
EXTEND_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
ESTIMATED = SPLIT_METHODS.index("estimated")
EXACT = SPLIT_METHODS.index("exact")


@dataclass(frozen=True)
class DrafterShape:
    """What the estimator needs of a drafter, from its server's resolved arguments."""

    algorithm: str | None
    draft_model: str | None
    topk: int
    num_steps: int
    verify_tokens: int

    @property
    def draft_passes(self) -> int:
        """Draft passes per decode iteration (the draft-extend included)."""
        if self.algorithm is None:
            return 0
        return self.num_steps + (1 if self.algorithm in EXTEND_ALGORITHMS else 0)

    @property
    def family(self) -> tuple[str, str, int] | None:
        """The family it regresses with; None: no draft steps to vary (n-gram, DFLASH)."""
        if self.algorithm is None or self.algorithm not in EXTEND_ALGORITHMS:
            return None
        return (self.algorithm, self.draft_model or "", self.topk)


def drafter_shapes(cube: xr.Dataset) -> dict[str, DrafterShape]:
    """Each drafter's shape from the cube's `server_args` attribute (what the servers
    resolved: SGLang's defaults filled in)."""
    try:
        servers = json.loads(str(cube.attrs.get("server_args", "{}")) or "{}")
    except ValueError as exc:
        raise AnalysisError(f"the cube's server_args attribute is not JSON: {exc}") from None
    shapes = {}
    for drafter in (str(d) for d in cube["drafter"].values):
        args = (servers.get(drafter) or {}).get("args") or {}
        algorithm = args.get("speculative_algorithm")
        if algorithm in (None, "", "none", "NONE"):
            shapes[drafter] = DrafterShape(None, None, 1, 0, 1)
            continue
        shapes[drafter] = DrafterShape(
            str(algorithm),
            args.get("speculative_draft_model_path"),
            int(args.get("speculative_eagle_topk") or 1),
            int(args.get("speculative_num_steps") or 0),
            int(args.get("speculative_num_draft_tokens") or 1),
        )
    return shapes


def fit_family(
    per_iter: np.ndarray, draft_passes: np.ndarray, verify_tokens: np.ndarray
) -> tuple[float, float, float]:
    """Least squares of per-iteration energy (or time) on draft passes and verify tokens:
    (c0, c_draft, c_verify); c_verify is 0 where the design cannot tell it from c_draft
    (see the module). NaN without two distinct draft-pass counts among the drafters."""
    ok = np.isfinite(per_iter)
    y, n, k = per_iter[ok], draft_passes[ok].astype(float), verify_tokens[ok].astype(float)
    if len(np.unique(n[n > 0])) < 2:
        return np.nan, np.nan, np.nan
    full = np.column_stack([np.ones_like(n), n, k])
    if np.linalg.matrix_rank(full) == 3:
        c0, cd, cv = np.linalg.lstsq(full, y, rcond=None)[0]
        if cv >= 0:
            return float(c0), float(cd), float(cv)
    c0, cd = np.linalg.lstsq(full[:, :2], y, rcond=None)[0]
    return float(c0), float(cd), 0.0


def estimate_split(cube: xr.Dataset) -> xr.Dataset:
    """The estimated drafting share of every cell a family covers (see the module): a
    Dataset on the cube's cell dimensions with energy_draft_j, energy_verify_overhead_j,
    time_draft_s, time_verify_overhead_s (NaN where no family covers the cell), the fitted
    draft_pass_energy_j (c_draft) and energy_split_method (estimated, or none)."""
    import xarray as xr

    shapes = drafter_shapes(cube)
    drafters = [str(d) for d in cube["drafter"].values]
    families = {s.family for s in shapes.values() if s.family is not None}
    iterations = _iterations(cube, shapes)
    valid = valid_mask(cube)
    energy = cube["energy_j"].where(valid)
    seconds = cube["decode_time_s"].where(valid)
    dims = [d for d in cube["energy_j"].dims if d != "drafter"]
    out = {
        name: xr.full_like(cube["energy_j"], np.nan)
        for name in (
            "energy_draft_j",
            "energy_verify_overhead_j",
            "time_draft_s",
            "time_verify_overhead_s",
            "draft_pass_energy_j",
        )
    }
    method = xr.zeros_like(cube["energy_j"], dtype=np.int8)
    for family in sorted(families):
        members = [d for d in drafters if shapes[d].family == family or shapes[d].algorithm is None]
        spec = [d for d in members if shapes[d].family == family]
        if len({shapes[d].num_steps for d in spec}) < 2:
            continue  # one setting: its drafting cannot be told from its verify pass's growth
        if not _drafting_told_apart(
            [shapes[d].draft_passes for d in spec], [shapes[d].verify_tokens for d in spec]
        ):
            continue
        n = np.array([shapes[d].draft_passes for d in members])
        k = np.array([shapes[d].verify_tokens for d in members])
        for total, var, rest, coef in (
            (energy, "energy_draft_j", "energy_verify_overhead_j", "draft_pass_energy_j"),
            (seconds, "time_draft_s", "time_verify_overhead_s", None),
        ):
            per_iter = (total / iterations).sel(drafter=members).transpose("drafter", *dims)
            stacked = per_iter.values.reshape(len(members), -1)
            fits = np.array([fit_family(stacked[:, j], n, k) for j in range(stacked.shape[1])])
            c_draft = fits[:, 1].reshape(per_iter.shape[1:])
            for d in spec:
                iters = iterations.sel(drafter=d).transpose(*dims).values
                draft = np.clip(iters * c_draft * shapes[d].draft_passes, 0.0, None)
                whole = total.sel(drafter=d).transpose(*dims).values
                draft = np.minimum(draft, whole)
                where = {"drafter": d}
                out[var].loc[where] = draft
                out[rest].loc[where] = whole - draft
                if coef is not None:
                    out[coef].loc[where] = c_draft
                    method.loc[where] = np.where(np.isfinite(draft), ESTIMATED, 0)
    ds = xr.Dataset(out)
    ds["energy_split_method"] = method
    _attrs(ds)
    return ds


#: Why a drafter gets no estimate (`no_estimate_reasons`), short enough for a figure's label.
NO_DRAFTER = "no drafter"
ON_THE_HOST = "drafts on the host"
NO_STEPS = "no draft steps to vary"
ONE_SETTING = "one num_steps setting"
IN_STEP = "verify grows with steps"
TOO_FEW = "too few valid cells"


def no_estimate_reasons(cube: xr.Dataset) -> dict[str, str]:
    """Why `estimate_split` gives each drafter no estimate, by drafter (see the module): no
    speculation (nothing drafted to split off), n-gram's drafting on the host, a drafter with
    no draft steps to vary (a single-pass block drafter such as DFLASH), a family of one
    `num_steps` setting, or one whose verified tokens move in step with its draft passes (a
    top-k 1 chain). A drafter of a family it estimates gets TOO_FEW: where one of its cells
    has no estimate, the fit lacked the valid cells of two draft-pass counts."""
    shapes = drafter_shapes(cube)
    reasons = {}
    for drafter, shape in shapes.items():
        if shape.algorithm is None:
            reasons[drafter] = NO_DRAFTER
        elif shape.family is None:
            reasons[drafter] = ON_THE_HOST if shape.algorithm.upper() == "NGRAM" else NO_STEPS
        else:
            spec = [s for s in shapes.values() if s.family == shape.family]
            if len({s.num_steps for s in spec}) < 2:
                reasons[drafter] = ONE_SETTING
            elif not _drafting_told_apart(
                [s.draft_passes for s in spec], [s.verify_tokens for s in spec]
            ):
                reasons[drafter] = IN_STEP
            else:
                reasons[drafter] = TOO_FEW
    return reasons


def _drafting_told_apart(draft_passes: list[int], verify_tokens: list[int]) -> bool:
    """Whether a family's own settings tell a draft pass's cost from a verified token's: the
    tokens they verify stay the same, or vary otherwise than in step with the draft passes.
    Where they move together (a top-k 1 chain verifies steps + 1 tokens; two settings whose
    tokens both change), only the anchor's plain decode tells them apart, and it lacks the
    speculative step's fixed costs: on the twin that overstated a chain's drafting 1.4-3.3x
    (5-32% of the cell's energy). Such a family gets no estimate rather than that one."""
    if len(set(verify_tokens)) == 1:
        return True
    design = np.column_stack([np.ones(len(draft_passes)), draft_passes, verify_tokens]).astype(
        float
    )
    return bool(np.linalg.matrix_rank(design) == 3)


def _iterations(cube: xr.Dataset, shapes: dict[str, DrafterShape]) -> xr.DataArray:
    """Decode iterations in each cell's windows: its tokens over the batch's tokens per
    iteration (accept length per request; 1 without speculation)."""
    import xarray as xr

    plain = xr.DataArray(
        [shapes[str(d)].algorithm is None for d in cube["drafter"].values],
        dims=["drafter"],
        coords={"drafter": cube["drafter"]},
    )
    accept = cube["accept_length"].where(~plain, 1.0)
    tokens = cube["window_tokens"] if "window_tokens" in cube else cube["output_tokens"]
    return tokens / (cube["batch"] * accept)


def _attrs(ds: xr.Dataset) -> None:
    names = {
        "energy_draft_j": ("J", "estimated energy of the drafter's passes in the windows"),
        "energy_verify_overhead_j": ("J", "estimated energy of verification and overhead"),
        "time_draft_s": ("s", "estimated time of the drafter's passes in the windows"),
        "time_verify_overhead_s": ("s", "estimated time of verification and overhead"),
        "draft_pass_energy_j": ("J", "fitted energy of one draft pass (c_draft)"),
    }
    for name, (units, long_name) in names.items():
        ds[name].attrs.update(units=units, long_name=long_name)
    ds["energy_split_method"].attrs.update(
        units="1",
        long_name="how the cell's energy split was obtained",
        flag_values=np.arange(len(SPLIT_METHODS), dtype=np.int8),
        flag_meanings=" ".join(SPLIT_METHODS),
    )


def where_energy_goes(cube: xr.Dataset) -> xr.Dataset:
    """Energy per output token by part (`SPLIT_PARTS`) per (drafter, batch, corpus), at the
    cube's reference setting (`reference_setting`: stock, else the closest), averaged over repeats:
    the exact split where the cells carry one, else the estimate (its verification and
    overhead under "verify", overhead NaN). Never averaged over corpora: a drafter's split
    moves with its acceptance on each corpus, and a partial cube's corpora differ from
    drafter to drafter. Variables: energy_per_token_<part>_j, and split_method per (drafter,
    batch, corpus): the `SPLIT_METHODS` index used (0: neither); measured: whether a valid
    cell is there at all (a split of 0 without one is "not measured", not "no energy");
    invalid: whether the reference setting has an invalid repeat and too few usable ones to be
    the reference, which leaves it out whole (`ruled_out_settings`, headroom's rule)."""
    import xarray as xr

    if "energy_split_method" not in cube:
        raise AnalysisError(
            "the cube has no energy split (built by a dvfs before it): rebuild it with "
            "`dvfs cube build`"
        )
    ref = reference_setting(cube)
    at = cube.sel(sm_clock=ref.sm_clock, power_limit=ref.power_limit)
    # a setting with an invalid repeat is left out whole, as headroom and the other figures do,
    # unless enough of its repeats are usable to be headroom's reference and stock energy
    bad = ruled_out_settings(cube).sel(sm_clock=ref.sm_clock, power_limit=ref.power_limit)
    valid = valid_mask(at) & ~bad
    tokens = at["window_tokens"].where(valid)
    exact = (at["energy_split_method"] == EXACT) & valid
    parts: dict[str, xr.DataArray] = {}
    estimate = estimate_split(at.expand_dims(sm_clock=[ref.sm_clock]))
    estimate = estimate.isel(sm_clock=0, drop=True)
    est = (estimate["energy_split_method"] == ESTIMATED) & valid & ~exact
    for part in SPLIT_PARTS:
        value = at[f"energy_{part}_j"].where(exact)
        if part == "draft":
            value = value.fillna(estimate["energy_draft_j"].where(est))
        elif part == "verify":
            value = value.fillna(estimate["energy_verify_overhead_j"].where(est))
        elif part == "prefill" and at.attrs.get("campaign"):
            value = value.fillna(xr.zeros_like(value).where(est & _fixed(at)))
        parts[part] = value / tokens
    reduce = [d for d in tokens.dims if d not in ("drafter", "batch", "corpus")]
    out = xr.Dataset(
        {
            f"energy_per_token_{part}_j": v.mean(reduce, skipna=True).assign_attrs(
                units="J", long_name=f"energy per output token: {part}"
            )
            for part, v in parts.items()
        }
    )
    method = xr.where(exact.any(reduce), EXACT, xr.where(est.any(reduce), ESTIMATED, 0))
    out["split_method"] = method.astype(np.int8).assign_attrs(
        units="1",
        long_name="how the split was obtained",
        flag_values=np.arange(len(SPLIT_METHODS), dtype=np.int8),
        flag_meanings=" ".join(SPLIT_METHODS),
    )
    out["measured"] = (
        valid.any(reduce)
        .astype(np.int8)
        .assign_attrs(units="1", long_name="a valid cell was measured at the reference (1)")
    )
    out["invalid"] = (
        bad.any([d for d in reduce if d in bad.dims])
        .astype(np.int8)
        .assign_attrs(
            units="1",
            long_name="the reference setting has an invalid repeat and too few usable ones (1)",
        )
    )
    out.attrs.update(
        reference_sm_clock_mhz=ref.sm_clock,
        reference_power_limit_w=ref.power_limit,
        reference_is_stock=int(ref.is_stock),
    )
    return out


def _fixed(cube: xr.Dataset) -> bool:
    """Whether the campaign decodes fixed batches (no prefill inside a steady window)."""
    try:
        return json.loads(str(cube.attrs["campaign"]))["workload"].get("mode", "fixed") == "fixed"
    except (KeyError, ValueError, TypeError, AttributeError):
        return False
