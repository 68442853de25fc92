"""Figures from a cube (seaborn on matplotlib's Agg backend): files in, nothing shown."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.analysis.headroom import headroom, reference_setting, valid_mask
from dvfs.analysis.targets import Target

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr

FORMATS = ("png", "pdf", "svg")


def _setup() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.95)
    return plt, sns


def _save(fig: Any, out_dir: Path, name: str, fmt: str) -> Path:
    path = out_dir / f"{name}.{fmt}"
    fig.savefig(path, dpi=130, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _frame(cube: xr.Dataset, names: list[str], **sel: Any) -> pd.DataFrame:
    ds = cube[names].where(valid_mask(cube)).sel(**sel).mean("repeat")
    return ds.to_dataframe().reset_index()


def _drafter_palette(cube: xr.Dataset, sns: Any) -> dict[str, Any]:
    drafters = [str(d) for d in cube["drafter"].values]
    return dict(zip(drafters, sns.color_palette("colorblind", len(drafters)), strict=True))


def energy_vs_clock(cube: xr.Dataset, out_dir: Path, fmt: str) -> list[Path]:
    """Energy per token against SM clock: a figure per corpus, a panel per batch, hue drafter."""
    plt, sns = _setup()
    ref = reference_setting(cube)
    paths = []
    palette = _drafter_palette(cube, sns)
    for corpus in cube["corpus"].values:
        df = _frame(cube, ["energy_per_token_j"], corpus=corpus, power_limit=ref.power_limit)
        df["energy per token (mJ)"] = df["energy_per_token_j"] * 1e3
        df = df.rename(columns={"sm_clock": "SM clock (MHz)"})
        grid = sns.relplot(
            data=df,
            x="SM clock (MHz)",
            y="energy per token (mJ)",
            hue="drafter",
            col="batch",
            kind="line",
            marker="o",
            markersize=4,
            palette=palette,
            height=3.0,
            aspect=0.9,
            facet_kws={"sharey": False},
            col_wrap=min(5, int(cube.sizes["batch"])),
        )
        grid.set_titles("batch {col_name}")
        grid.figure.suptitle(
            f"Energy per token vs SM clock - corpus {corpus} "
            f"(power limit {ref.power_limit:g} W, {cube.attrs.get('gpu_name', '')})",
            y=1.04,
        )
        paths.append(_save(grid.figure, out_dir, f"energy_vs_clock_{corpus}", fmt))
    return paths


def _pareto_front(points: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Points no other point beats on both latency and energy."""
    ordered = points.dropna(subset=[x, y]).sort_values([x, y])
    front = ordered[ordered[y] <= ordered[y].cummin()]
    return front


def pareto(
    cube: xr.Dataset, chosen: xr.Dataset, target: Target, out_dir: Path, fmt: str
) -> list[Path]:
    """Energy-latency trade-off per batch, Pareto front per drafter, chosen settings starred."""
    plt, sns = _setup()
    palette = _drafter_palette(cube, sns)
    lat_name = f"{target.metric.upper()} {target.quantile_name} (ms)"
    paths = []
    batches = [int(b) for b in cube["batch"].values]
    for corpus in cube["corpus"].values:
        df = _frame(
            cube, ["energy_per_token_j", target.variable], corpus=corpus, quantile=target.quantile
        )
        df["energy per token (mJ)"] = df["energy_per_token_j"] * 1e3
        df[lat_name] = df[target.variable]
        ncols = min(5, len(batches))
        nrows = int(np.ceil(len(batches) / ncols))
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False)
        for ax, batch in zip(axes.flat, batches, strict=False):
            part = df[df["batch"] == batch]
            sns.scatterplot(
                data=part,
                x=lat_name,
                y="energy per token (mJ)",
                hue="drafter",
                palette=palette,
                s=14,
                alpha=0.45,
                ax=ax,
                legend=False,
            )
            for drafter, group in part.groupby("drafter"):
                front = _pareto_front(group, lat_name, "energy per token (mJ)")
                ax.plot(
                    front[lat_name], front["energy per token (mJ)"], color=palette[drafter], lw=1.5
                )
                pick = chosen.sel(batch=batch, drafter=drafter, corpus=corpus)
                if bool(pick["feasible"]):
                    ax.scatter(
                        float(pick["chosen_latency_ms"]),
                        float(pick["chosen_energy_per_token_j"]) * 1e3,
                        marker="*",
                        s=160,
                        color=palette[drafter],
                        edgecolor="black",
                        linewidth=0.6,
                        zorder=5,
                    )
            ax.set_title(f"batch {batch}")
        for ax in list(axes.flat)[len(batches) :]:
            ax.set_visible(False)
        handles = [
            plt.Line2D([], [], color=c, marker="o", lw=1.5, label=d) for d, c in palette.items()
        ]
        handles.append(
            plt.Line2D(
                [],
                [],
                color="gray",
                marker="*",
                lw=0,
                markersize=12,
                markeredgecolor="black",
                label="chosen (headroom)",
            )
        )
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
        fig.suptitle(
            f"Energy vs latency, every clock and power limit - corpus {corpus}\n"
            f"lines: Pareto fronts; stars: least energy with {target.describe()}",
            y=1.02,
        )
        fig.tight_layout()
        paths.append(_save(fig, out_dir, f"pareto_{corpus}", fmt))
    return paths


def acceptance_heatmap(cube: xr.Dataset, out_dir: Path, fmt: str) -> Path | None:
    plt, sns = _setup()
    if "accept_length" not in cube:
        return None
    accept = cube["accept_length"].where(valid_mask(cube))
    table: Any = accept.mean([d for d in accept.dims if d not in ("drafter", "corpus")]).to_pandas()
    table = table.dropna(how="all")
    if table.empty:
        return None
    fig, ax = plt.subplots(figsize=(1.3 * table.shape[1] + 2, 0.6 * table.shape[0] + 1.5))
    sns.heatmap(
        table,
        annot=True,
        fmt=".2f",
        cmap="viridis",
        ax=ax,
        cbar_kws={"label": "tokens per verify pass"},
    )
    ax.tick_params(axis="y", rotation=0)
    ax.set_title("Mean accept length (bonus token included)")
    ax.set_xlabel("corpus")
    ax.set_ylabel("drafter")
    return _save(fig, out_dir, "acceptance", fmt)


def headroom_heatmap(chosen: xr.Dataset, out_dir: Path, fmt: str) -> Path:
    plt, sns = _setup()
    corpora = [str(c) for c in chosen["corpus"].values]
    ncols = min(3, len(corpora))
    nrows = int(np.ceil(len(corpora) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False)
    for ax, corpus in zip(axes.flat, corpora, strict=False):
        part = chosen.sel(corpus=corpus)
        saving = (part["saving"] * 100).transpose("drafter", "batch").to_pandas()
        clock = part["chosen_sm_clock"].transpose("drafter", "batch").to_pandas()
        limit = part["chosen_power_limit"].transpose("drafter", "batch").to_pandas()
        stock_limit = float(chosen.attrs.get("reference_power_limit_w", np.nan))
        labels = saving.copy().astype(object)
        for i in range(saving.shape[0]):
            for j in range(saving.shape[1]):
                s, c, p = saving.iat[i, j], clock.iat[i, j], limit.iat[i, j]
                capped = f"\n{p:.0f} W" if not np.isnan(p) and p < stock_limit else ""
                labels.iat[i, j] = "none\nfeasible" if np.isnan(s) else f"{s:.0f}%\n{c:.0f}{capped}"
        sns.heatmap(
            saving,
            annot=labels,
            fmt="",
            cmap="Greens",
            vmin=0,
            ax=ax,
            annot_kws={"fontsize": 7},
            cbar_kws={"label": "energy saved (%)"},
        )
        ax.tick_params(axis="y", rotation=0)
        ax.set_title(f"corpus {corpus}")
        ax.set_xlabel("batch")
        ax.set_ylabel("drafter")
    for ax in list(axes.flat)[len(corpora) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Headroom: energy saved at the least-energy setting meeting "
        f"{chosen.attrs.get('target', '')}\n"
        "(cell text: saving, chosen SM clock MHz, and the power limit when capped)",
        y=1.03,
    )
    fig.tight_layout()
    return _save(fig, out_dir, "headroom", fmt)


def timelines(cube: xr.Dataset, chosen: xr.Dataset, out_dir: Path, fmt: str) -> Path | None:
    """Power and SM clock through the measurement window: stock vs chosen setting."""
    if "timeline_power_w" not in cube or np.all(np.isnan(cube["timeline_power_w"].values)):
        return None
    plt, sns = _setup()
    ref = reference_setting(cube)
    drafters = [str(d) for d in cube["drafter"].values][:2]
    batches = [int(cube["batch"].values[0]), int(cube["batch"].values[-1])]
    corpus = str(cube["corpus"].values[0])
    fig, axes = plt.subplots(
        2, len(batches), figsize=(5.5 * len(batches), 5.2), squeeze=False, sharex="col"
    )
    colors = sns.color_palette("colorblind", 4)
    for col, batch in enumerate(batches):
        k = 0
        for drafter in drafters:
            pick = chosen.sel(batch=batch, drafter=drafter, corpus=corpus)
            settings = [("stock", ref.sm_clock, ref.power_limit)]
            if bool(pick["feasible"]):
                settings.append(
                    ("chosen", int(pick["chosen_sm_clock"]), float(pick["chosen_power_limit"]))
                )
            for label, clock, limit in settings:
                cell = cube.sel(
                    batch=batch,
                    drafter=drafter,
                    corpus=corpus,
                    sm_clock=clock,
                    power_limit=limit,
                    repeat=cube["repeat"].values[0],
                )
                t = cell["timeline_t_s"].values
                keep = ~np.isnan(t)
                name = f"{drafter}, {label} ({clock} MHz, {limit:g} W)"
                axes[0, col].plot(
                    t[keep],
                    cell["timeline_power_w"].values[keep],
                    color=colors[k % 4],
                    label=name,
                    drawstyle="steps-post",
                )
                axes[1, col].plot(
                    t[keep],
                    cell["timeline_sm_clock_mhz"].values[keep],
                    color=colors[k % 4],
                    drawstyle="steps-post",
                )
                k += 1
        axes[0, col].set_title(f"batch {batch}, corpus {corpus}")
        axes[0, col].set_ylabel("GPU power (W)")
        axes[1, col].set_ylabel("SM clock (MHz)")
        axes[1, col].set_xlabel("time in steady-state window (s)")
        axes[0, col].legend(fontsize=7, loc="lower right")
    fig.suptitle("Power and clock timelines (sampled during the measurement window)")
    fig.tight_layout()
    return _save(fig, out_dir, "timelines", fmt)


def plot_all(
    cube: xr.Dataset, out_dir: str | Path, *, fmt: str = "png", target: Target | None = None
) -> list[Path]:
    """Every figure dvfs draws for a cube; returns the files written."""
    if fmt not in FORMATS:
        from dvfs.errors import AnalysisError

        raise AnalysisError(f"unknown figure format {fmt!r}; choose {', '.join(FORMATS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = target or Target("preserve", slack=0.05)
    if "gpu" in cube.dims:  # a merged cube: one set of figures per GPU
        paths: list[Path] = []
        for gpu in cube["gpu"].values:
            one = cube.sel(gpu=gpu, drop=True)
            paths += plot_all(one, out / str(gpu)[:12], fmt=fmt, target=target)
        return paths
    chosen = headroom(cube, target=target)
    paths = []
    paths += energy_vs_clock(cube, out, fmt)
    paths += pareto(cube, chosen, target, out, fmt)
    for extra in (
        acceptance_heatmap(cube, out, fmt),
        headroom_heatmap(chosen, out, fmt),
        timelines(cube, chosen, out, fmt),
    ):
        if extra is not None:
            paths.append(extra)
    return paths
