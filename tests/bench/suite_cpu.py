"""Where the test suite's CPU goes (issue 15's "under 60 s on two cores"): a pytest plugin that
records, in every xdist worker, each test's CPU (its own process and the children it waited
for) and the in-process CPU of the costs that recur across tests (cube writes and opens,
sweeps' runners, thermal stabilisation), then a report of both.

    PYTHONPATH=tests/bench .venv/bin/python -m pytest -p suite_cpu
    .venv/bin/python tests/bench/suite_cpu.py

The records go to `$DVFS_SUITE_CPU` (default /tmp/dvfs-suite-cpu) and add up over runs until
`suite_cpu.py --clear` deletes them. CPU is
`resource.getrusage`'s user+sys: a test's figure includes what its threads spent (stub
servers), and the recurring costs are process CPU while the call ran, outermost call only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("DVFS_SUITE_CPU", "/tmp/dvfs-suite-cpu"))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")

_started: dict[str, tuple[float, float]] = {}
_costs: dict[str, list[float]] = {}
_inside: set[str] = set()


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _timed(label: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, its process CPU added to `label` (the outermost call only: a sweep's runner
    inside another's is counted once)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if label in _inside:
            return func(*args, **kwargs)
        _inside.add(label)
        start = time.process_time()
        try:
            return func(*args, **kwargs)
        finally:
            _inside.discard(label)
            cost = _costs.setdefault(label, [0.0, 0])
            cost[0] += time.process_time() - start
            cost[1] += 1

    return wrapper


def pytest_configure(config: Any) -> None:
    del config
    import xarray

    from dvfs.cube import files
    from dvfs.measure import baseline, runner

    # netCDF writes: write_cube's own (it calls no to_netcdf) and every other to_netcdf
    files._write_netcdf4 = _timed("cube writes", files._write_netcdf4)
    xarray.Dataset.to_netcdf = _timed("cube writes", xarray.Dataset.to_netcdf)  # type: ignore[method-assign]
    xarray.open_dataset = _timed("cube opens", xarray.open_dataset)
    runner.Runner.run = _timed("sweeps' runners", runner.Runner.run)  # type: ignore[method-assign]
    baseline.stabilise = _timed("thermal stabilisation", baseline.stabilise)


def pytest_runtest_setup(item: Any) -> None:
    _started[item.nodeid] = _cpu()


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    del location
    if nodeid not in _started:
        return
    own0, children0 = _started.pop(nodeid)
    own1, children1 = _cpu()
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"tests-{_WORKER}-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps([nodeid, own1 - own0, children1 - children0]) + "\n")


def pytest_sessionfinish(session: Any) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    own, children = _cpu()
    if _WORKER == "main" and getattr(session.config.option, "numprocesses", None):
        children = 0.0  # xdist's controller: its children are the workers, counted by each
    summary = {"costs": _costs, "process_cpu_s": own, "children_cpu_s": children}
    (OUT / f"costs-{_WORKER}-{os.getpid()}.json").write_text(json.dumps(summary))


def report(folder: Path, top: int) -> str:
    """The recorded runs, added up: CPU by recurring cost, by test file and the costliest
    tests."""
    tests = [
        json.loads(line)
        for path in sorted(folder.glob("tests-*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    costs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for path in sorted(folder.glob("costs-*.json")):
        summary = json.loads(path.read_text())
        total += summary["process_cpu_s"] + summary["children_cpu_s"]
        for label, (seconds, calls) in summary["costs"].items():
            costs[label][0] += seconds
            costs[label][1] += calls
    if not tests:
        return f"no records in {folder}: run the suite with `-p suite_cpu` first"
    in_tests = sum(own + children for _, own, children in tests)
    lines = [
        f"{len(tests)} tests: {in_tests:.1f} CPU-s in tests, {total:.1f} CPU-s in all "
        "(the controller, each worker and the children they waited for)"
    ]
    for label, (seconds, calls) in sorted(costs.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {label:24s} {seconds:7.1f} CPU-s in {int(calls)} calls")
    by_file: Counter[str] = Counter()
    for nodeid, own, children in tests:
        by_file[nodeid.split("::")[0]] += own + children
    lines.append(f"costliest files (of {len(by_file)}):")
    lines += [f"  {seconds:6.1f}  {name}" for name, seconds in by_file.most_common(top)]
    lines.append("costliest tests (own + children CPU-s):")
    for nodeid, own, children in sorted(tests, key=lambda t: -(t[1] + t[2]))[:top]:
        lines.append(f"  {own:5.2f} + {children:5.2f}  {nodeid}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=15, help="files and tests to list")
    parser.add_argument("--clear", action="store_true", help="delete the records instead")
    args = parser.parse_args(argv)
    if args.clear:
        for path in [*OUT.glob("tests-*.jsonl"), *OUT.glob("costs-*.json")]:
            path.unlink()
        return 0
    print(report(OUT, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
