"""Issue 15's proof: the code before the issue (commit 42bc906, built outside the tree) and the
working tree, measured side by side in one run on this machine.

Reports the demo sweep's CPU time (user+sys of the child), `dvfs plot` on the demo cube, the
peak RSS of a 4x demo campaign against the demo's, and whether the new cube equals the old one
within the twin's determinism. Not part of the suite: `python tests/bench/bench_speed.py`.
Each measured command is its own child process, waited with os.wait4, so its rusage is its own.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

REPO = Path(__file__).resolve().parents[2]
BEFORE = "42bc906"
TARGET_SWEEP_CPU_S = 15.0
TARGET_SPEEDUP = 4.0
TARGET_PLOT_S = 5.0
TARGET_MEMORY_RATIO = 1.3


@dataclass(frozen=True)
class Run:
    """One child process: CPU seconds, wall seconds, peak RSS and exit status."""

    cpu_s: float
    wall_s: float
    maxrss_mib: float
    returncode: int
    output: str


@dataclass(frozen=True)
class Tree:
    """A copy of dvfs to run: its label and the PYTHONPATH that makes `import dvfs` find it."""

    label: str
    root: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(self.root)
        env["MPLBACKEND"] = "Agg"
        return env


def run(tree: Tree, args: list[str], cwd: Path) -> Run:
    """Run `python -m dvfs ARGS` from TREE in its own process and measure that process alone."""
    import time

    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", *args],
            cwd=cwd,
            env=tree.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()[-2000:]
    return Run(
        cpu_s=usage.ru_utime + usage.ru_stime,
        wall_s=wall,
        maxrss_mib=usage.ru_maxrss / 1024,  # KiB on Linux
        returncode=proc.returncode,
        output=output,
    )


def checked(tree: Tree, args: list[str], cwd: Path, what: str) -> Run:
    result = run(tree, args, cwd)
    if result.returncode != 0:
        sys.exit(f"{tree.label}: {what} failed ({result.returncode}):\n{result.output}")
    return result


def extract_before(dest: Path) -> Tree:
    """The tree at BEFORE, written by `git archive` into DEST (no checkout is touched)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BEFORE], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return Tree(f"old ({BEFORE})", dest)


def where_dvfs_is(tree: Tree, cwd: Path) -> str:
    code = "import dvfs; print(dvfs.__file__)"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=tree.env(), capture_output=True, text=True
    ).stdout.strip()


def campaign_times(source: Path, dest: Path, repeats: int) -> Path:
    """The demo campaign with `repeats` repeats (repeats x the cells, same cube dims but one)."""
    text = source.read_text()
    text, n = re.subn(r"(?m)^repeats\s*=\s*\d+", f"repeats = {repeats}", text)
    if n != 1:
        sys.exit(f"cannot set repeats in {source}")
    dest.write_text(text.replace('name = "demo"', f'name = "demo{repeats}x"'))
    return dest


def compare_cubes(old: Path, new: Path, rtol: float) -> tuple[bool, list[str]]:
    """Per data variable: max abs and rel difference; equal when every one is within rtol."""
    a, b = xr.open_dataset(old), xr.open_dataset(new)
    lines, ok = [], True
    for name in sorted(str(n) for n in set(a.data_vars) | set(b.data_vars)):
        if name not in a or name not in b:
            lines.append(f"  {name}: only in the {'new' if name in b else 'old'} cube")
            ok = False
            continue
        x, y = a[name].values, b[name].values
        if x.shape != y.shape:
            lines.append(f"  {name}: shape {x.shape} vs {y.shape}")
            ok = False
            continue
        if x.dtype.kind not in "fiub" or y.dtype.kind not in "fiub":
            if not np.array_equal(x.astype(str), y.astype(str)):
                lines.append(f"  {name}: labels differ")
                ok = False
            continue
        x, y = x.astype(float), y.astype(float)
        nan_same = np.array_equal(np.isnan(x), np.isnan(y))
        both = ~np.isnan(x) & ~np.isnan(y)
        diff = np.abs(x[both] - y[both])
        scale = np.maximum(np.abs(x[both]), np.abs(y[both]))
        abs_d = float(diff.max()) if diff.size else 0.0
        rel_d = float((diff / np.where(scale > 0, scale, 1)).max()) if diff.size else 0.0
        good = nan_same and rel_d <= rtol
        ok &= good
        if not good:
            lines.append(f"  {name}: max abs {abs_d:.3g}, max rel {rel_d:.3g}, NaN same {nan_same}")
    for dim in a.dims:
        if dim in b.dims and not np.array_equal(a[dim].values, b[dim].values):
            lines.append(f"  coordinate {dim} differs")
            ok = False
    return ok, lines


def verdict(good: bool) -> str:
    return "PASS" if good else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-old-4x", action="store_true", help="no 4x campaign on the old code")
    parser.add_argument("--rtol", type=float, default=1e-9, help="cube equality tolerance")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    opts = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dvfs-bench-speed-"))
    old, new = extract_before(work / "old"), Tree("new (working tree)", REPO)
    neutral = work / "cwd"
    neutral.mkdir()
    for tree in (old, new):
        print(f"{tree.label}: dvfs from {where_dvfs_is(tree, neutral)}")
    demo = old.root / "dvfs" / "campaigns" / "demo.toml"  # the reference campaign, for both
    bench4x = REPO / "tests" / "bench" / "demo4x.toml"
    demo4x = bench4x if bench4x.exists() else campaign_times(demo, work / "demo4x.toml", 4)
    print(f"demo campaign: {demo}\n4x campaign: {demo4x}\n")

    sweeps: dict[str, Run] = {}
    plots: dict[str, Run] = {}
    big: dict[str, Run] = {}
    for tree in (old, new):
        tag = "old" if tree is old else "new"
        out = work / f"demo-{tag}"
        sweeps[tag] = checked(
            tree, ["sweep", str(demo), "--out", str(out), "--no-progress"], neutral, "demo sweep"
        )
        plots[tag] = checked(
            tree,
            ["plot", str(out / "cube.nc"), "--out", str(work / f"plots-{tag}")],
            neutral,
            "plot",
        )
        if tree is new or not opts.skip_old_4x:
            big[tag] = checked(
                tree,
                ["sweep", str(demo4x), "--out", str(work / f"demo4x-{tag}"), "--no-progress"],
                neutral,
                "4x sweep",
            )

    def row(what: str, runs: dict[str, Run], field: str, unit: str) -> None:
        o, n = runs.get("old"), runs.get("new")
        ov = f"{getattr(o, field):8.1f}" if o else "       -"
        nv = f"{getattr(n, field):8.1f}" if n else "       -"
        print(f"{what:<34} {ov} {nv}  {unit}")

    print(f"{'':<34} {'old':>8} {'new':>8}")
    row("demo sweep CPU (user+sys)", sweeps, "cpu_s", "s")
    row("demo sweep wall", sweeps, "wall_s", "s")
    row("demo sweep peak RSS", sweeps, "maxrss_mib", "MiB")
    row("dvfs plot (demo cube) CPU", plots, "cpu_s", "s")
    row("dvfs plot (demo cube) wall", plots, "wall_s", "s")
    row("4x demo sweep CPU", big, "cpu_s", "s")
    row("4x demo sweep peak RSS", big, "maxrss_mib", "MiB")
    print()

    speedup = sweeps["old"].cpu_s / sweeps["new"].cpu_s
    sweep_ok = sweeps["new"].cpu_s <= TARGET_SWEEP_CPU_S and speedup >= TARGET_SPEEDUP
    print(
        f"[{verdict(sweep_ok)}] demo sweep: {sweeps['new'].cpu_s:.1f} s CPU "
        f"(<= {TARGET_SWEEP_CPU_S:.0f} s), {speedup:.1f}x faster (>= {TARGET_SPEEDUP:.0f}x)"
    )
    plot_ok = plots["new"].cpu_s <= TARGET_PLOT_S  # CPU: a shared machine's wall time varies
    print(
        f"[{verdict(plot_ok)}] dvfs plot: {plots['new'].cpu_s:.1f} s CPU "
        f"(<= {TARGET_PLOT_S:.0f} s), {plots['new'].wall_s:.1f} s wall; "
        f"old {plots['old'].cpu_s:.1f} s CPU "
        f"({plots['old'].cpu_s / plots['new'].cpu_s:.1f}x)"
    )
    ratio = big["new"].maxrss_mib / sweeps["new"].maxrss_mib
    old_ratio = (
        f"; old {big['old'].maxrss_mib / sweeps['old'].maxrss_mib:.2f}x" if "old" in big else ""
    )
    print(
        f"[{verdict(ratio <= TARGET_MEMORY_RATIO)}] peak RSS 4x/demo: {ratio:.2f}x "
        f"(<= {TARGET_MEMORY_RATIO}x){old_ratio}"
    )
    same, lines = compare_cubes(
        work / "demo-old" / "cube.nc", work / "demo-new" / "cube.nc", opts.rtol
    )
    print(f"[{verdict(same)}] new demo cube equals the old one (rtol {opts.rtol:g})")
    print("\n".join(lines))
    if opts.keep:
        print(f"work folder: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
