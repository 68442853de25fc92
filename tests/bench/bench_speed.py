"""Issue 15's proof: the code before the issue (commit 42bc906, built outside the tree) and the
working tree, measured side by side in one run on this machine.

Reports the demo sweep's CPU time (user+sys of the child), `dvfs plot` on the demo cube, the
peak RSS of a 4x demo campaign against the demo's, and whether the new cube equals the
reference's within the twin's determinism. The reference is commit 2c79446 (also built outside
the tree): today's twin physics and measurement protocol (issue 13's physics included) before
the last round of speed work, with the physics fixes made since applied to its copy
(`REFERENCE_PHYSICS_FIXES`), so its demo cube is the one a sweep by the working tree must
give. The cube differs from 42bc906's by design, since issues 11 and 13 changed the twin's
physics and the protocol after it, so 42bc906 is measured for time and memory only; the
reference's sweep CPU is shown too.
Not part of the suite: `python tests/bench/bench_speed.py`. Each measured command is its own
child process, waited with os.wait4, so its rusage is its own.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from same_cube import compare  # noqa: E402  (beside this file)

REPO = Path(__file__).resolve().parents[2]
BEFORE = "42bc906"
#: The cube's reference: today's physics and protocol (issues 11 and 13: rounds ending at the
#: window, the power limit per pass, the speculative iteration's costs, the energy split)
#: before the last round of speed work; a sweep by the working tree must give the same cube.
REFERENCE = "2c79446"
#: Variables a later change altered on purpose, so they are left out of the comparison with the
#: reference (and shown apart): SGLang's accept length covers whole blocks of
#: `decode_log_interval` decode iterations only, and the twin now reports it as a server would
#: (NaN for a round shorter than one block).
CHANGED_SINCE_REFERENCE = {
    "server_accept_length": "the server's figure now covers whole blocks of decode iterations",
    "prompt_tokens": "added later: the mean input tokens each cell's rounds sent",
    "timeline_t_s": "the sampler's closing reading at a round's window's close (GPU idle) left out",
    "timeline_power_w": "no idle closing reading: the line no longer dips at each round's close",
    "timeline_sm_clock_mhz": "no idle closing reading: its clock no longer drawn at the close",
    "sm_clock_observed_mhz": "the idle closing reading's clock no longer in the mean",
    "clock_event_reasons": "the idle closing reading's GpuIdle (0x1) no longer in the reasons",
}
#: Drafters whose every cell changed on purpose since the reference, left out of the comparison.
DRAFTERS_CHANGED_SINCE_REFERENCE = {
    "dflash": "its Romansh acceptance corrected to the romansh rule (3.30 -> 2.85, 737e4be); its "
    "cells share one simulated timeline, so those of every corpus move",
}
ATTENTION_FIX = (
    "the weight GEMMs' tile and wave quantisation no longer stretches a pass's attention FLOPs"
)
#: Physics fixes made after the reference, applied to its extracted copy (path, the text the
#: reference has, the fixed text), so that its cube stays the one the working tree must give.
REFERENCE_PHYSICS_FIXES = (
    (
        "dvfs/twin/device.py",
        "return limit - LEAKAGE_LIMIT_STEP_W * round(extra / LEAKAGE_LIMIT_STEP_W)",
        "return limit - extra",
        "a warm die's leakage counts against the power limit exactly, not in 5 W steps",
    ),
    # A pass's attention FLOPs (a new Passes field, set where passes are counted) are not
    # stretched by the weight GEMMs' tile and wave quantisation: the same numbers as the
    # working tree's `_pass_terms`.
    (
        "dvfs/twin/physics.py",
        "    spec_tokens: np.ndarray = None  # type: ignore[assignment]\n",
        "    spec_tokens: np.ndarray = None  # type: ignore[assignment]\n"
        "    attention_flops: np.ndarray = None  # type: ignore[assignment]\n",
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/physics.py",
        'for name in ("tokens", "verify_kv_bytes", "spec_requests", "spec_tokens"):',
        'for name in ("tokens", "verify_kv_bytes", "spec_requests", "spec_tokens",'
        ' "attention_flops"):',
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/physics.py",
        "    compute_s = useful_s * (gpu.gemm_efficiency / gemm_efficiency(gpu, passes.tokens))\n",
        "    gemm_stretch = gpu.gemm_efficiency / gemm_efficiency(gpu, passes.tokens)\n"
        "    attn_flops = passes.attention_flops\n"
        "    gemm_stretch = np.where(attn_flops > 0, ((passes.flops - attn_flops) * gemm_stretch"
        " + attn_flops) / np.maximum(passes.flops, 1e-300), gemm_stretch)\n"
        "    compute_s = useful_s * gemm_stretch\n",
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/passes.py",
        "        self.parts.append(Passes(flops, bytes_, layers, comm, calls, launched, m))",
        "        zeros = np.zeros(len(flops))\n"
        "        attention = np.asarray(attn_flops, dtype=float) / self.tp\n"
        "        self.parts.append(Passes(flops, bytes_, layers, comm, calls, launched, m,"
        " zeros, zeros, zeros, attention))",
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/passes.py",
        "        verify_tokens if speculative else zeros,\n    )",
        "        verify_tokens if speculative else zeros,\n"
        "        verify_attn / builder.tp,\n    )",
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/passes.py",
        "        drafts = (*counted, np.stack(tokens, axis=1), none, none, none)",
        "        drafts = (*counted, np.stack(tokens, axis=1), none, none, none,"
        " np.stack([per_token * t for t in attn_tokens], axis=1) / builder.tp)",
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/passes.py",
        "    flops, bytes_, layers, comm, calls, m, verify_kv, requests, spec_tokens = (",
        "    flops, bytes_, layers, comm, calls, m, verify_kv, requests, spec_tokens,"
        " attention = (",
        ATTENTION_FIX,
    ),
    (
        "dvfs/twin/passes.py",
        "            spec_tokens,\n        )\n    )\n    return width",
        "            spec_tokens,\n            attention,\n        )\n    )\n    return width",
        ATTENTION_FIX,
    ),
)
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


def extract(commit: str, dest: Path, label: str) -> Tree:
    """The tree at COMMIT, written by `git archive` into DEST (no checkout is touched)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return Tree(f"{label} ({commit})", dest)


def with_physics_fixes(tree: Tree) -> Tree:
    """TREE with `REFERENCE_PHYSICS_FIXES` applied, each said; a fix whose text is not found
    stops the benchmark (the reference changed, and the comparison would mislead)."""
    for path, before, after, why in REFERENCE_PHYSICS_FIXES:
        source = tree.root / path
        text = source.read_text()
        if text.count(before) != 1:
            sys.exit(f"{tree.label}: {path} lacks the text the fix '{why}' replaces")
        source.write_text(text.replace(before, after))
        print(f"{tree.label}: physics fix applied: {why}")
    return tree


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


def engine_runs(journal: Path) -> tuple[int, int]:
    """Cells and engine runs (measured rounds, warm-ups and thermal-stabilisation loads) a demo
    sweep's journal records: the work a sweep did, which differs between the trees by design
    (the old protocol measured fewer rounds a cell, and warmed up every cell with a short run)."""
    import json

    cells = runs = 0
    with journal.open("rb") as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") != "cell" or not record.get("measurement"):
                continue
            warmup = record.get("warmup") or {}
            cells += 1
            runs += int(record["measurement"]["rounds"])
            runs += int(bool(warmup.get("warmed_up", bool(warmup))))
            runs += int((warmup.get("stabilised") or {}).get("loads", 0))
    return cells, runs


def verdict(good: bool) -> str:
    return "PASS" if good else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-old-4x", action="store_true", help="no 4x campaign on the old code")
    parser.add_argument(
        "--rtol", type=float, default=0.0, help="cube equality tolerance (0: bit-equal)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="demo sweeps per tree, interleaved (old, reference, new, old, ...), and plots of "
        "its cube; the least CPU of each tree's is reported (a shared machine's load only adds "
        "to a run's CPU)",
    )
    parser.add_argument(
        "--reference",
        default=REFERENCE,
        help=f"the commit whose demo cube the new one must equal (default {REFERENCE})",
    )
    opts = parser.parse_args()
    if opts.runs < 1:
        parser.error("--runs must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="dvfs-bench-speed-"))
    old = extract(BEFORE, work / "old", "old")
    ref = with_physics_fixes(extract(opts.reference, work / "ref", "reference"))
    new = Tree("new (working tree)", REPO)
    neutral = work / "cwd"
    neutral.mkdir()
    for tree in (old, ref, new):
        # Every tree's bytecode compiled first: where PYTHONDONTWRITEBYTECODE is set, a tree
        # without __pycache__ would pay for compiling dvfs in every measured run.
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(tree.root / "dvfs")], check=True
        )
        print(f"{tree.label}: dvfs from {where_dvfs_is(tree, neutral)} (bytecode compiled)")
    demo = old.root / "dvfs" / "campaigns" / "demo.toml"  # the reference campaign, for all
    bench4x = REPO / "tests" / "bench" / "demo4x.toml"
    demo4x = bench4x if bench4x.exists() else campaign_times(demo, work / "demo4x.toml", 4)
    print(f"demo campaign: {demo}\n4x campaign: {demo4x}\n")

    sweeps: dict[str, Run] = {}
    plots: dict[str, Run] = {}
    big: dict[str, Run] = {}
    trees = (("old", old), ("ref", ref), ("new", new))
    all_cpu: dict[str, list[float]] = {tag: [] for tag, _ in trees}
    for _ in range(opts.runs):
        for tag, tree in trees:
            out = work / f"demo-{tag}"
            shutil.rmtree(out, ignore_errors=True)
            args = ["sweep", str(demo), "--out", str(out), "--no-progress"]
            result = checked(tree, args, neutral, "demo sweep")
            all_cpu[tag].append(result.cpu_s)
            if tag not in sweeps or result.cpu_s < sweeps[tag].cpu_s:
                sweeps[tag] = result
    if opts.runs > 1:
        for tag, tree in trees:
            runs = ", ".join(f"{c:.1f}" for c in all_cpu[tag])
            print(f"demo sweep CPU, {tree.label}: {runs} s (least {min(all_cpu[tag]):.1f})")
        print()
    for tag, tree in trees:
        out = work / f"demo-{tag}"
        if tag == "ref":
            continue  # the reference is for the cube (and its CPU, shown beside)
        for _ in range(opts.runs):  # the least CPU of `runs`, as for the sweeps
            shutil.rmtree(work / f"plots-{tag}", ignore_errors=True)
            drawn = checked(
                tree,
                ["plot", str(out / "cube.nc"), "--out", str(work / f"plots-{tag}")],
                neutral,
                "plot",
            )
            if tag not in plots or drawn.cpu_s < plots[tag].cpu_s:
                plots[tag] = drawn
        if tree is new or not opts.skip_old_4x:
            big[tag] = checked(
                tree,
                ["sweep", str(demo4x), "--out", str(work / f"demo4x-{tag}"), "--no-progress"],
                neutral,
                "4x sweep",
            )

    def row(what: str, runs: dict[str, Run], field: str, unit: str) -> None:
        cells = []
        for tag in ("old", "ref", "new"):
            r = runs.get(tag)
            cells.append(f"{getattr(r, field):9.1f}" if r else "        -")
        print(f"{what:<34} {' '.join(cells)}  {unit}")

    print(f"{'':<34} {'old':>9} {'reference':>9} {'new':>9}")
    print(f"{'':<34} {BEFORE:>9} {opts.reference[:9]:>9} {'tree':>9}")
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
        f"(<= {TARGET_SWEEP_CPU_S:.0f} s), {speedup:.1f}x faster (>= {TARGET_SPEEDUP:.0f}x); "
        f"{sweeps['ref'].cpu_s / sweeps['new'].cpu_s:.2f}x the reference's speed"
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
    cube = "cube.nc"
    changed = frozenset(CHANGED_SINCE_REFERENCE)
    drafters = frozenset(DRAFTERS_CHANGED_SINCE_REFERENCE)
    same, lines, n = compare(
        work / "demo-ref" / cube,
        work / "demo-new" / cube,
        opts.rtol,
        leave_out=changed,
        leave_out_drafters=drafters,
    )
    print(
        f"[{verdict(same)}] new demo cube equals the reference's ({opts.reference}): "
        f"{n} variables and coordinates, rtol {opts.rtol:g}, NaN == NaN"
        + (f"; left out, changed on purpose: {', '.join(sorted(changed))}" if changed else "")
        + (f"; drafters left out: {', '.join(sorted(drafters))}" if drafters else "")
    )
    for drafter, why in DRAFTERS_CHANGED_SINCE_REFERENCE.items():
        print(f"[info] drafter {drafter} left out: {why}")
    for line in lines:
        print(f"  {line}")
    _, on_purpose, _ = compare(work / "demo-ref" / cube, work / "demo-new" / cube, opts.rtol)
    for line in on_purpose:
        name = line.split(":", 1)[0]
        why = CHANGED_SINCE_REFERENCE.get(name)
        if why:
            print(f"[info] {line} ({why})")
    _, old_lines, _ = compare(work / "demo-old" / cube, work / "demo-new" / cube, opts.rtol)
    print(
        f"[info] vs the old cube ({BEFORE}): {len(old_lines)} difference(s), by design: issues "
        "11 and 13 changed the twin's physics and the protocol after it"
    )
    work_done = {tag: engine_runs(work / f"demo-{tag}" / "journal.jsonl") for tag, _ in trees}
    per_run = {tag: sweeps[tag].cpu_s / work_done[tag][1] * 1e3 for tag, _ in trees}
    for tag, tree in trees:
        n_cells, n_runs = work_done[tag]
        print(
            f"[info] {tree.label}: {n_runs} engine runs for {n_cells} cells "
            f"({n_runs / n_cells:.2f} a cell), {per_run[tag]:.2f} ms CPU a run"
        )
    print(
        f"[info] per engine run the new code is {per_run['old'] / per_run['new']:.1f}x the old's "
        f"speed and {per_run['ref'] / per_run['new']:.1f}x the reference's; rounds differ in "
        "length between the trees, so this is a rough measure of the work, not a target"
    )
    if opts.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
