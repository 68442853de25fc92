"""Where verification turns compute-bound: the verify pass's arithmetic intensity vs the ridge.

With batch B and k verified tokens per request, a verify pass does ~2 P B k FLOPs for ~2 P bytes
of weights (plus the KV cache it reads, and the KV of its B k tokens it writes). Past the ridge
point (FLOP per byte at which compute time equals memory time; it falls with the SM clock) the
pass is compute-bound: lowering the clock then costs latency, and wasted drafts cost energy.

The ridge is the twin's: achievable FLOP/s (GEMM efficiency at the pass's token count for
its weight GEMMs' FLOPs, `dvfs.twin.physics.compute_stretch`) over achievable bandwidth (a
speculative verify pass's KV-cache reads at the verify attention's lower bandwidth), at the
same context length the twin's workload runs at, so the analysis and the twin's physics agree
on where a pass turns compute-bound.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from dvfs.errors import AnalysisError

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.twin.profiles import GpuProfile


def verify_tokens_per_request(cube: xr.Dataset) -> dict[str, int | None]:
    """Tokens each request verifies per pass: from the drafter's server's resolved arguments,
    else (a drafter whose server never started: a partial cube) from its settings in the
    campaign the cube records; None where neither says (never a guessed 1)."""
    servers = json.loads(cube.attrs.get("server_args", "{}") or "{}")
    try:
        planned = {
            str(d["name"]): d for d in json.loads(cube.attrs.get("campaign", "{}"))["drafters"]
        }
    except (KeyError, TypeError, ValueError):
        planned = {}
    widths: dict[str, int | None] = {}
    for drafter in map(str, cube["drafter"].values):
        if drafter in servers:
            args = servers[drafter].get("args", {})
            algorithm = args.get("speculative_algorithm")
            tokens = args.get("speculative_num_draft_tokens")
        elif drafter in planned:
            algorithm = planned[drafter].get("algorithm")
            tokens = planned[drafter].get("num_draft_tokens")
        else:
            widths[drafter] = None
            continue
        if not algorithm:
            widths[drafter] = 1  # no speculation: one token per request per pass
        else:
            widths[drafter] = int(tokens) if tokens else None
    return widths


def recorded_prompt_tokens(cube: xr.Dataset) -> float | None:
    """The mean input tokens of the prompts the cube's sweep drew, from what each cell records
    its rounds sent (`prompt_tokens`): averaged over each corpus's measured cells, then over
    the corpora (each weighs alike in its cells). None where the cube does not record it for
    every measured cell (a cube of an earlier dvfs, or merged with one): part of its cells
    would stand in for the others'."""
    from dvfs.cube.schema import STATUS_OK

    if "prompt_tokens" not in cube.data_vars or "corpus" not in cube["prompt_tokens"].dims:
        return None
    sent = cube["prompt_tokens"].where(cube["cell_status"] == STATUS_OK)
    measured = cube["cell_status"] == STATUS_OK
    if not measured.any() or bool((measured & sent.isnull()).any()):
        return None
    per_corpus = sent.mean([d for d in sent.dims if d != "corpus"], skipna=True).values
    per_corpus = per_corpus[np.isfinite(per_corpus)]
    return float(per_corpus.mean()) if per_corpus.size else None


def mean_context_tokens(
    cube: xr.Dataset,
    *,
    prompt_tokens: float | str | None = None,
    notes: list[str] | None = None,
) -> float:
    """The mean context a decode pass of the cube's cells attends to: the mean input tokens of
    the prompts the sweep drew plus half the output. `prompt_tokens`: that mean where the
    caller read it (`dvfs.cube.prompts.reread_prompt_tokens`, for a cube that does not record
    it), or in words why it cannot be known; None: the cube's record
    (`recorded_prompt_tokens`). Where there is none, the midpoint of the campaign's
    input_tokens range, said in `notes` with the reason: the range only bounds the prompts
    (the built-in corpora's average 140-200 tokens of the demo's 16-2048), and a context too
    long overstates the KV cache read. Reads nothing but the cube."""
    try:
        workload = json.loads(cube.attrs["campaign"])["workload"]
        lo, hi = workload["input_tokens"]
        output = workload["output_tokens"] / 2
    except (KeyError, ValueError, TypeError):
        return 1024.0
    prompts = recorded_prompt_tokens(cube) if prompt_tokens is None else prompt_tokens
    if prompts is None or isinstance(prompts, str):
        unknown = (
            f"cannot be read again here: {prompts}"
            if prompts is not None
            else "the cube does not record (an earlier dvfs's cube: `dvfs compare` and "
            "`dvfs report` read them again from its campaign's corpora)"
        )
        note = (
            f"roofline context: the middle of workload.input_tokens ({(lo + hi) / 2:.0f} "
            "tokens) stands in for the mean of the prompts the sweep drew (the verify passes' "
            f"FLOP/B are low if those were shorter), which {unknown}"
        )
        # Said once for a merged cube's models; a cube whose campaign names no corpora (one
        # built by hand) drew no prompts to say anything of.
        if notes is not None and note not in notes and "corpora" in workload:
            notes.append(note)
        return (lo + hi) / 2 + output
    return prompts + output


def _measured_points(measured: xr.Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    known = measured["sm_clock_mhz"].values.astype(float)
    ridge = measured["ridge_point"].values.astype(float)
    ok = np.isfinite(known) & np.isfinite(ridge)
    if not ok.any():
        raise AnalysisError(
            "the roofline file records no SM clock (measured without a GPU?): its ridge cannot "
            "be placed on the cube's clocks"
        )
    return known, ridge, ok


def _cube_models(cube: xr.Dataset) -> list[str]:
    """The GPU model of each of the cube's GPUs (a merged cube's `gpu_names`), else its one
    model; none where the cube names none."""
    if "gpu" in cube.dims:
        try:
            names = [str(n) for n in json.loads(str(cube.attrs.get("gpu_names") or "[]"))]
        except ValueError:
            names = []
        if names:
            return list(dict.fromkeys(names))
    name = cube.attrs.get("gpu_name")
    return [str(name)] if name else []


def check_measured(measured: xr.Dataset, cube: xr.Dataset) -> None:
    """Refuse a roofline with no clock, or one measured on another GPU model than the cube's
    (every GPU's of a merged cube): its ridge points would place another GPU's compute-bound
    turn on the cube's clocks. A twin's name (" (twin)") matches the model it simulates."""
    _measured_points(measured)
    theirs = str(measured.attrs.get("gpu_name") or "")
    ours = _cube_models(cube)
    if theirs and any(o.removesuffix(" (twin)") != theirs.removesuffix(" (twin)") for o in ours):
        raise AnalysisError(
            f"the roofline was measured on {theirs}, the cube on {', '.join(ours)}: its ridge "
            "points are another GPU's; measure the roofline on the cube's GPU model (`dvfs gpu "
            "roofline -o FILE`), or drop --roofline to use the twin's"
        )


def measured_ridge(measured: xr.Dataset, clocks: np.ndarray) -> np.ndarray:
    """A measured roofline's ridge point at each of `clocks` (MHz).

    Linear between the measured clocks; outside them the nearest measurement scaled with the
    clock (peak FLOP/s scales with f, bandwidth hardly does above the knee), so a cube clock
    below the lowest measured one is not given a ridge that stops falling.
    """
    known, ridge, ok = _measured_points(measured)
    order = np.argsort(known[ok])
    f, r = known[ok][order], ridge[ok][order]
    clocks = np.asarray(clocks, dtype=float)
    inside = np.interp(clocks, f, r)
    below = r[0] * clocks / f[0]
    above = r[-1] * clocks / f[-1]
    return np.where(clocks < f[0], below, np.where(clocks > f[-1], above, inside))


def rooflines(
    cube: xr.Dataset,
    *,
    measured: xr.Dataset | None = None,
    notes: list[str] | None = None,
    left_out: list[str] | None = None,
    context_tokens: float | None = None,
) -> list[xr.Dataset]:
    """The verify pass against each GPU model's ridge point: one roofline (`roofline`) for a
    one-GPU cube, a merged cube of one model, or with a `measured` roofline (one GPU's); one per
    model, on its first GPU's own cube, for a merged cube of several models, whose ridge points
    differ (an H200 reads memory faster than an H100 computing as fast). A model of those the
    twin has no profile of is left out, said in `notes`, and the others kept (an `AnalysisError`
    where it has none of them), its model's name added to `left_out` (for the JSON, whose
    `roofline` is then another model's): a measured roofline serves that GPU's own cube, not
    the merged one (`check_measured`). `context_tokens`: as `roofline` takes it, for each
    model whose own cells do not record their prompts (None: each model's own cube's record,
    `mean_context_tokens`); a model whose cells do keeps its record."""
    import json

    from dvfs.analysis.headroom import single_gpu
    from dvfs.twin.profiles import matching_gpu_profile, recorded_gpu_profile

    if measured is not None or "gpu" not in cube.dims:
        return [roofline(cube, context_tokens=context_tokens, measured=measured, notes=notes)]
    labels = [str(g) for g in cube["gpu"].values]
    try:
        names = [str(n) for n in json.loads(str(cube.attrs.get("gpu_names") or "[]"))]
    except ValueError:
        names = []
    if len(names) != len(labels):
        return [roofline(cube, context_tokens=context_tokens, notes=notes)]
    first: dict[str, tuple[str, str]] = {}  # profile -> its first GPU's label and model name
    for label, name in zip(labels, names, strict=True):
        known = matching_gpu_profile(name.removesuffix(" (twin)"))
        first.setdefault(known.key if known is not None else name, (label, name))
    if len(first) == 1:
        return [roofline(cube, context_tokens=context_tokens, notes=notes)]
    made, unknown = [], []
    for label, name in first.values():
        one = single_gpu(cube, label).assign_attrs(gpu_name=name)
        if recorded_gpu_profile(one.attrs) is None:
            unknown.append(name)
        else:
            # a model whose own cells record their prompts keeps that context; the one given
            # stands in for a model of an earlier dvfs's cube (merged with newer ones)
            own = None if recorded_prompt_tokens(one) is not None else context_tokens
            made.append(roofline(one, context_tokens=own, notes=notes))
    if unknown:
        them = "them" if len(unknown) > 1 else "it"
        measure = (
            f"measure the ridge points on {them} with `dvfs gpu roofline -o FILE` and give the "
            "file to `dvfs compare --roofline FILE` with that GPU's own cube (a merged cube "
            "takes no one GPU's roofline)"
        )
        if not made:
            raise AnalysisError(f"the twin has no profile of {', '.join(unknown)}: {measure}")
        if left_out is not None:
            left_out += unknown
        if notes is not None:
            notes.append(
                f"no roofline of {', '.join(unknown)}: the twin has no profile of {them}; "
                + measure
            )
    return made


def _cube_gpu(cube: xr.Dataset) -> GpuProfile:
    """The twin profile of the cube's GPU, whose ridge points the twin gives: a twin cube's
    own profile, else the one its GPU's name matches (`recorded_gpu_profile`: a real GPU's
    `twin_profile` is the twin that estimated its time, not its model). A GPU the twin has no
    profile of is an `AnalysisError` saying how to measure them, not another GPU's ridge under
    its name (the H100's stood in for an A100's)."""
    from dvfs.twin.profiles import recorded_gpu_profile

    name = str(cube.attrs.get("gpu_name") or "")
    found = recorded_gpu_profile(cube.attrs)
    if found is None:
        raise AnalysisError(
            f"the twin has no profile of the cube's GPU ({name or 'not recorded'}), so it cannot "
            "give that GPU's ridge points: measure them on it with `dvfs gpu roofline -o FILE` "
            "and give that to `dvfs compare --roofline FILE`"
        )
    return found


def roofline(
    cube: xr.Dataset,
    *,
    context_tokens: float | None = None,
    measured: xr.Dataset | None = None,
    notes: list[str] | None = None,
) -> xr.Dataset:
    """Verify-pass intensity per (batch, drafter) against the ridge point at each SM clock, at
    `context_tokens` of context (None: what the cube records its cells' prompts were, plus
    half the output: `mean_context_tokens`; the analysis reads no file); `measured` (a
    roofline file, `dvfs.roofline.store.read`) replaces the twin's achievable ridge. A pass of
    few tokens meets the bandwidth at a lower ridge (the twin profile's GEMM tiles and
    waves), a speculative verify pass at a higher one (its KV-cache reads at the profile's
    `verify_attention_efficiency`, as the twin's physics times them); with a measured
    roofline of a GPU the twin has no profile of, there is none to move it by: the verify
    ridge is the measured one, its `gpu_profile` None (not another GPU's, whose curve stood
    in under its name), and `notes` says what that means.
    A context not taken from the cube's record (an earlier dvfs's cube) is said in `notes` and
    in the result's `context_note` attribute."""
    import xarray as xr

    from dvfs.twin.fit import achievable_ridge_point
    from dvfs.twin.physics import compute_stretch
    from dvfs.twin.profiles import find_model_profile, recorded_gpu_profile

    model_name = cube.attrs.get("twin_model") or cube.attrs.get("model")
    model = find_model_profile(str(model_name)) if model_name else None
    if model is None:
        named = f"{model_name!r} has no twin profile" if model_name else "the cube names no model"
        raise AnalysisError(
            f"the roofline needs the model's shape, and {named}; "
            "set engine.twin_model in the campaign to one of the twin's model profiles"
        )
    gpu = _cube_gpu(cube) if measured is None else recorded_gpu_profile(cube.attrs)
    tp = int(cube.attrs.get("tp_size", 1))
    said: list[str] = []  # how the context was taken, where not as the cells recorded it
    context = (
        context_tokens if context_tokens is not None else mean_context_tokens(cube, notes=said)
    )
    if notes is not None:
        notes += [note for note in said if note not in notes]
    widths = verify_tokens_per_request(cube)
    batches = cube["batch"].values.astype(int)
    drafters = [str(d) for d in cube["drafter"].values]
    clocks = cube["sm_clock"].values.astype(float)
    intensity = np.empty((len(batches), len(drafters)))
    tokens = np.empty_like(intensity)
    # A speculative verify pass reads the KV cache through a custom-mask (tree) attention
    # kernel at `verify_attention_efficiency` of the bandwidth (the twin's physics times it
    # so): its bytes take longer to read than as many bytes of plain decode, so it meets the
    # compute time at a higher intensity. `stretch`: its memory time over its bytes' at the
    # bandwidth.
    stretch = np.ones_like(intensity)
    attention = np.zeros_like(intensity)  # the pass's attention FLOPs (of `flops`)
    all_flops = np.zeros_like(intensity)
    slow = 0.0 if gpu is None else 1.0 / gpu.verify_attention_efficiency - 1.0
    for i, batch in enumerate(batches):
        for j, drafter in enumerate(drafters):
            width = widths[drafter]
            if width is None:  # nothing says how wide its verify pass is: no data
                intensity[i, j] = tokens[i, j] = np.nan
                continue
            n = batch * width
            attention[i, j] = float(model.attention_flops_per_token(context)) * n
            flops = 2.0 * model.active_matmul_params * n + attention[i, j]
            all_flops[i, j] = flops
            # the weights once, each request's KV cache at the context, and the KV of every
            # token it verifies written (drafts too: SGLang frees the rejected slots after), as
            # the twin's physics counts the pass (`dvfs.twin.passes.count_passes`)
            kv = batch * float(model.kv_bytes_read(context))
            bytes_ = float(model.weight_bytes_read(n)) + kv + n * model.kv_bytes_per_token
            intensity[i, j] = (flops / tp) / (bytes_ / tp)
            tokens[i, j] = n
            if width > 1:
                stretch[i, j] = (bytes_ + kv * slow) / bytes_
    if measured is None:
        assert gpu is not None  # `_cube_gpu` refuses a GPU the twin has no profile of
        ridge = np.array([achievable_ridge_point(gpu, c) for c in clocks])
        source = f"twin physics ({gpu.key})"
    else:
        ridge = measured_ridge(measured, clocks)
        name = measured.attrs.get("gpu_name") or measured.attrs.get("device_name", "?")
        source = f"measured ({name})"
        if gpu is None:
            source += ", the best GEMM's at every pass's token count"
            if notes is not None:
                notes.append(
                    f"the verify passes are set against the measured ridge of the best GEMM: "
                    f"the twin has no profile of {name} to lower it for a pass of few tokens "
                    "(GEMM tiles and waves part-filled), nor to raise it for a speculative "
                    "verify pass's KV-cache reads (its tree attention's lower bandwidth), so a "
                    "pass of few tokens may turn compute-bound above the clock given (or where "
                    "it says never), and a verify pass reading a long context's KV cache only "
                    "below it (or never): read those clocks as estimates, neither bound"
                )
    result = xr.Dataset(
        {
            "verify_tokens": (
                ("batch", "drafter"),
                tokens,
                {"units": "1", "long_name": "tokens in one verify pass (batch x k)"},
            ),
            "arithmetic_intensity": (
                ("batch", "drafter"),
                intensity,
                {"units": "FLOP byte-1", "long_name": "verify-pass FLOPs per byte read"},
            ),
            "ridge_point": (
                ("sm_clock",),
                ridge,
                {
                    "units": "FLOP byte-1",
                    "long_name": "FLOP per byte where compute time equals memory time",
                },
            ),
        },
        coords={"batch": batches, "drafter": drafters, "sm_clock": clocks.astype(int)},
    )
    # A pass of fewer tokens than fill its GEMMs' tiles and waves reaches less of the peak
    # FLOP/s, so it meets the bandwidth at a lower intensity: the large-M ridge times that share
    # (of its weight GEMMs' FLOPs only: its attention's are not padded, as the twin's physics
    # times them, `compute_stretch`); a speculative verify pass's slower KV-cache reads raise
    # it again (`stretch`).
    share = (
        np.ones_like(tokens)
        if gpu is None
        else 1.0 / compute_stretch(gpu, tokens, all_flops, attention)
    )
    result["verify_ridge_point"] = (
        result["ridge_point"] * xr.DataArray(share * stretch, dims=("batch", "drafter"))
    ).assign_attrs(
        units="FLOP byte-1",
        long_name="ridge point of the verify pass (GEMM tile and wave quantisation at its token "
        "count, its KV-cache reads at the verify attention's bandwidth)",
    )
    result["compute_bound"] = (
        result["arithmetic_intensity"] > result["verify_ridge_point"]
    ).assign_attrs(units="1", long_name="verify pass is past the ridge point at this clock")
    result.attrs.update(
        model=model.key,
        gpu_profile=None if gpu is None else gpu.key,
        context_tokens=context,
        tp_size=tp,
        ridge=source,
    )
    if said:  # for a caller that passed no notes (`ds.dvfs.roofline()`)
        result.attrs["context_note"] = said[0]
    return result
