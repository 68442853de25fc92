"""Figures from a cube, drawn with plain matplotlib on an Agg canvas: files in, nothing shown.

Each `draw_*` function returns a `matplotlib.figure.Figure` (tests inspect it); `plot_all`
draws every figure and saves it. Energy is in J per token, as in `dvfs headroom`'s table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dvfs.analysis.headroom import headroom
from dvfs.analysis.split import no_estimate_reasons, where_energy_goes
from dvfs.analysis.targets import Target
from dvfs.collector import few_collections
from dvfs.cube.schema import SPLIT_MEANINGS, STATUS_MISSING
from dvfs.plots.batch import draw_energy_vs_batch
from dvfs.plots.curves import (
    corpus_panels,
    draw_energy_vs_clock,
    draw_pareto,
    energy_title,
    longest_corpus,
    pareto_title,
    target_text,
)
from dvfs.plots.data import pareto_front, usable_mask
from dvfs.plots.heatmaps import draw_acceptance, draw_headroom
from dvfs.plots.limits import (
    draw_energy_vs_power_limit,
    draw_latency_vs_power_limit,
    energy_limit_title,
    latency_limit_title,
)
from dvfs.plots.split import draw_energy_split, parts_drawn, split_panels, worth_drawing
from dvfs.plots.style import save
from dvfs.plots.timelines import draw_timelines

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.figure import Figure

FORMATS = ("png", "pdf", "svg")

__all__ = [
    "FORMATS",
    "corpus_panels",
    "draw_acceptance",
    "draw_energy_split",
    "draw_energy_vs_batch",
    "draw_energy_vs_clock",
    "draw_headroom",
    "draw_latency_vs_power_limit",
    "draw_energy_vs_power_limit",
    "draw_pareto",
    "draw_timelines",
    "pareto_front",
    "per_gpu",
    "plot_all",
    "figures",
    "split_parts",
]


def figures(
    cube: xr.Dataset,
    target: Target,
    *,
    knob: str = "both",
    confidence: float = 0.95,
    drafters: Sequence[str] = (),
    grid_from_data: bool = False,
) -> Iterator[tuple[str, Figure]]:
    """Every figure for a single-GPU cube, with its file name (no extension), one at a time.
    The chosen settings they mark are `dvfs headroom`'s for `target`, `knob` and `confidence`.
    `drafters` (none: all) are the rows of the headroom map, as of `dvfs headroom --drafter`'s
    table: a cube cut to some drafters keeps the baseline for the target and for the curves
    it is drawn against, but the map is of the drafters asked for, and so are the timelines
    (none asked: the cube's first two with valid cells, the others named). `grid_from_data`:
    the cube is one GPU of a merged cube (`per_gpu`), its answers those `dvfs headroom` gives
    that GPU on the merged cube (another GPU's stock setting is outside its grid, not
    unmeasured).

    The per-corpus figures of a kind (energy vs clock, Pareto fronts, energy split) are one
    Figure drawn again for each corpus: save (or inspect) each figure before asking for the
    next.
    """
    chosen = headroom(
        cube, target=target, knob=knob, confidence=confidence, grid_from_data=grid_from_data
    )
    corpora = [str(c) for c in cube["corpus"].values]
    widest = longest_corpus(cube)
    usable = usable_mask(cube)  # once for every figure: each would make it anew
    # One SM clock (a power-limit-only grid, or one clock locked): nothing varies along the
    # clock axis, and an unlocked clock would be drawn as a lock. As the energy-vs-batch figure
    # for one batch size, none is drawn; where the power limit varies, energy and latency are
    # drawn against it instead, as the clock sweep's energy is against the clock.
    if measured_clocks(cube) > 1:
        curves = corpus_panels(cube, energy_title(cube, widest))
        for corpus in corpora:
            drawn = draw_energy_vs_clock(cube, corpus, curves, usable=usable)
            yield f"energy_vs_clock_{corpus}", drawn
    elif measured(cube, "power_limit") > 1:
        said = target_text(chosen, target)
        energy = corpus_panels(cube, energy_limit_title(cube, widest))
        for corpus in corpora:
            drawn = draw_energy_vs_power_limit(cube, chosen, corpus, energy, usable=usable)
            yield f"energy_vs_power_limit_{corpus}", drawn
        latency = corpus_panels(cube, latency_limit_title(cube, target, said, widest))
        for corpus in corpora:
            drawn = draw_latency_vs_power_limit(
                cube, chosen, target, corpus, latency, usable=usable, target_text=said
            )
            yield f"latency_vs_power_limit_{corpus}", drawn
    fronts = corpus_panels(cube, pareto_title(target_text(chosen, target), widest))
    for corpus in corpora:
        yield f"pareto_{corpus}", draw_pareto(cube, chosen, target, corpus, fronts, usable=usable)
    if "energy_split_method" in cube:
        split = where_energy_goes(cube)
        worth = worth_drawing(split, no_estimate_reasons(cube))
        bars = split_panels(split) if worth else None
        for corpus in corpora:
            if (fig := draw_energy_split(cube, corpus, split, bars)) is not None:
                yield f"energy_split_{corpus}", fig
    for name, fig in (
        ("acceptance", draw_acceptance(cube, usable)),
        ("headroom", draw_headroom(only_drafters(chosen, drafters))),
        ("timelines", draw_timelines(cube, chosen, drafters)),
        ("energy_vs_batch", draw_energy_vs_batch(cube, usable)),
    ):
        if fig is not None:
            yield name, fig


def split_parts(cube: xr.Dataset) -> dict[str, list[str]]:
    """Each energy-split figure `plot_all` may draw of `cube`, by its name (no extension; in
    its GPU's folder for a merged cube), and the parts it draws (`parts_drawn`): the report's
    caption names those, not a prefill part the figure leaves out at 0 J."""
    if "gpu" in cube.dims:
        return {
            f"{folder}/{name}": parts
            for folder, one in per_gpu(cube)
            for name, parts in split_parts(one).items()
        }
    if "energy_split_method" not in cube:
        return {}
    split = where_energy_goes(cube)
    return {
        f"energy_split_{corpus}": parts_drawn(split.sel(corpus=corpus))
        for corpus in (str(c) for c in split["corpus"].values)
    }


def only_drafters(chosen: xr.Dataset, drafters: Sequence[str]) -> xr.Dataset:
    """`chosen` cut to `drafters` (in its own order); all of it when `drafters` is empty."""
    if not drafters:
        return chosen
    return chosen.sel(drafter=[d for d in chosen["drafter"].values if str(d) in drafters])


#: Variables the timelines figure reads where the cube has sampled power, and those the energy
#: split reads where it has a split (a cube may have neither: those figures are left out).
TIMELINE_VARIABLES = ("timeline_t_s", "timeline_power_w", "timeline_sm_clock_mhz")
SPLIT_VARIABLES = (
    "energy_j",
    "decode_time_s",
    "accept_length",
    "window_tokens",
    *(f"energy_{part}_j" for part in SPLIT_MEANINGS),
)


def measured_clocks(cube: xr.Dataset) -> int:
    """How many SM clocks of the cube hold a cell it measured (or tried to). One GPU of a
    merged cube keeps the whole merge's clock axis: on a power-limit-only grid that is each
    GPU's own stock clock, so a GPU that measured at one clock has two on its axis."""
    return measured(cube, "sm_clock")


def measured(cube: xr.Dataset, knob: str) -> int:
    """How many values of `knob` (sm_clock, power_limit) hold a cell the cube measured (or
    tried to)."""
    status = cube["cell_status"]
    tried = (status != STATUS_MISSING).any([d for d in status.dims if d != knob])
    return int(tried.sum())


def missing_for_figures(cube: xr.Dataset) -> list[str]:
    """The variables some figure reads that `cube` lacks (the analyses' own are checked when
    the cube is opened)."""
    needed: list[str] = []
    if "timeline_power_w" in cube:
        needed += TIMELINE_VARIABLES
    if "energy_split_method" in cube:
        needed += SPLIT_VARIABLES
    return [name for name in needed if name not in cube]


def plot_all(
    cube: xr.Dataset,
    out_dir: str | Path,
    *,
    fmt: str = "png",
    target: Target | None = None,
    knob: str = "both",
    confidence: float = 0.95,
    drafters: Sequence[str] = (),
    grid_from_data: bool = False,
) -> list[Path]:
    """Every figure dvfs draws for a cube; returns the files written (a folder per GPU for a
    merged cube). `knob` and `confidence` are `dvfs headroom`'s: the chosen settings marked
    are the ones its table gives for them (`dvfs report` passes its own, and its --drafter
    as `drafters`, the headroom map's rows); each GPU's of a merged cube as `dvfs headroom`
    gives them on the merged cube (`grid_from_data`, as `figures` takes it)."""
    # the figures make hundreds of thousands of small objects (artists, transforms, paths):
    # the collector runs less often, and leaves out the objects that exist before drawing
    with few_collections(freeze=True):
        return _plot_all(
            cube,
            Path(out_dir),
            fmt=fmt,
            target=target,
            knob=knob,
            confidence=confidence,
            drafters=drafters,
            grid_from_data=grid_from_data,
        )


def _plot_all(
    cube: xr.Dataset,
    out: Path,
    *,
    fmt: str,
    target: Target | None,
    knob: str,
    confidence: float,
    drafters: Sequence[str],
    grid_from_data: bool,
) -> list[Path]:
    """`plot_all`'s work, under its garbage collection (`few_collections`)."""
    if fmt not in FORMATS:
        from dvfs.errors import AnalysisError

        raise AnalysisError(f"unknown figure format {fmt!r}; choose {', '.join(FORMATS)}")
    missing = missing_for_figures(cube)
    if missing:
        from dvfs.errors import CubeError

        raise CubeError(
            f"the cube has no {', '.join(missing)}, which the figures need (a damaged or "
            "hand-edited cube?): rebuild it with `dvfs cube build SWEEP_DIR`"
        )
    out.mkdir(parents=True, exist_ok=True)
    target = target or Target("preserve", slack=0.05)
    if "gpu" in cube.dims:  # a merged cube: one set of figures per GPU
        paths: list[Path] = []
        for folder, one in per_gpu(cube):
            paths += _plot_all(
                one,
                out / folder,
                fmt=fmt,
                target=target,
                knob=knob,
                confidence=confidence,
                drafters=drafters,
                grid_from_data=True,
            )
        return paths
    drawn = figures(
        cube,
        target,
        knob=knob,
        confidence=confidence,
        drafters=drafters,
        grid_from_data=grid_from_data,
    )
    return [save(fig, out, name, fmt) for name, fig in drawn]


def per_gpu(cube: xr.Dataset) -> list[tuple[str, xr.Dataset]]:
    """Each GPU of a merged cube as its own cube, with the folder its figures go in: its own
    stock setting and its own model name (the merged cube's `gpu_name` is the first GPU's),
    and along a knob its campaign left at stock only its own settings (`own_grid`)."""
    from dvfs.analysis.headroom import single_gpu
    from dvfs.report.common import gpu_names

    names = gpu_names(cube)
    out = []
    for gpu, (label, folder) in zip(cube["gpu"].values, folders_of(cube).items(), strict=True):
        one = single_gpu(cube, gpu)
        one.attrs["gpu_name"] = names.get(label, label)
        one.attrs.pop("gpu_names", None)
        out.append((folder, one))
    return out


def folders_of(cube: xr.Dataset) -> dict[str, str]:
    """Each GPU of a merged cube (its label) and the folder its figures go in
    (`gpu_folders`): one naming for the figures and for the report that captions them."""
    from dvfs.report.common import gpu_names

    labels = [str(gpu) for gpu in cube["gpu"].values]
    names = gpu_names(cube)
    return dict(zip(labels, gpu_folders(labels, [names.get(g, g) for g in labels]), strict=True))


def gpu_folders(labels: list[str], models: list[str] | None = None) -> list[str]:
    """A folder name per GPU of a merged cube, that tells a reader which GPU it is: its model
    and its short UUID ("nvidia-h200-twin-GPU-f39e88b9"; a fleet cube's comma-joined UUIDs
    joined by "+"). Where the short UUIDs of two GPUs are the same (UUIDs may share long
    prefixes), every folder has the whole label; a number is added should two still come out
    the same. A model equal to its label (a cube without `gpu_names`) is left out."""
    import re

    def plain(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "+", text).strip("+.")

    def short(label: str) -> str:
        return ",".join(u[:12] for u in label.split(","))

    cut = [short(label) for label in labels]
    ids = cut if len(set(cut)) == len(cut) else labels
    models = models or labels
    folders: list[str] = []
    for label, model, uuid in zip(labels, models, ids, strict=True):
        name = "" if model == label else re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
        base = "-".join(p for p in (name, plain(uuid)) if p) or "gpu"
        folder, n = base, 2
        while folder in folders:
            folder, n = f"{base}-{n}", n + 1
        folders.append(folder)
    return folders
