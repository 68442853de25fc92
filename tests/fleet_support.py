"""The reduced demo campaign the fleet tests share (local workers, Ray, shards)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from conftest import default_dispositions, subprocess_env

#: Three drafters, so several workers must share or switch servers; the exact twin (no NVML
#: traps), so each GPU's cells reproduce exactly whichever worker runs them.
_FLEET_CAMPAIGN = """
[campaign]
name = "{name}"

[gpu]
backend = "twin"
profile = "h100-sxm:none"  # the exact twin: each GPU's cells reproduce exactly
devices = [0]

[knobs]
sm_clock = [1980, 1410, 1005]
power_limit = [700, 350]
settle_s = 1.0

[engine]
backend = "twin"
model = "llama-3.1-8b"

[drafters.none]
algorithm = "none"

[drafters.eagle3]
algorithm = "EAGLE3"
draft_model = "eagle3-llama-3.1-8b"
num_steps = 3
eagle_topk = 1
num_draft_tokens = 4

[drafters.ngram]
algorithm = "NGRAM"
num_draft_tokens = 8

[workload]
batch = [1, 8]
corpora = ["code", "conversation"]
input_tokens = [16, 2048]
output_tokens = 48

[measurement]
warmup_tokens = 8
min_window_s = 0.2
max_rounds = 2
repeats = {repeats}
sample_period_s = 0.02
idle_s = 1.0
"""


def fleet_campaign(name: str, repeats: int = 1) -> str:
    """The campaign's TOML text under NAME with REPEATS interleaved repeats."""
    return _FLEET_CAMPAIGN.format(name=name, repeats=repeats)


#: The fleet campaign as the tests that share its runs (the `swept` fixture) name it.
FLEET = fleet_campaign("fleet")


def assert_same_cells(a, b, *, above_idle_rtol: float = 1e-4) -> None:
    """Two cubes of one campaign hold the same grid and values. Energy (and the power read off
    the energy counter) may differ by the counter's 1 mJ quantisation, since the counter's
    absolute value depends on what ran before on that GPU; above-idle energy subtracts about
    half of it, doubling the relative step (`above_idle_rtol`). GPU time is left out: each
    worker or shard pays its own server starts and settles."""
    import numpy as np

    assert set(a.data_vars) == set(b.data_vars)
    for dim in a.dims:
        np.testing.assert_array_equal(a[dim].values, b[dim].values)
    for name in a.data_vars:
        if str(name).startswith("gpu_time_"):
            continue
        if a[name].dtype.kind in "OUS":
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
            continue
        if str(name).endswith("_rel_ci"):
            # two rounds' t (12.7) times the difference of their energies: absolute
            np.testing.assert_allclose(a[name].values, b[name].values, atol=5e-3, equal_nan=True)
            continue
        counted = "energy" in name or "power_mean" in name or "power_max" in name  # (summarise)
        rtol = 1e-4 if counted else 1e-12
        if "above_idle" in name:
            rtol = above_idle_rtol
        np.testing.assert_allclose(
            a[name].values, b[name].values, rtol=rtol, equal_nan=True, err_msg=name
        )


def refuse_servers_on(monkeypatch, label: str, why: str | None = None) -> None:
    """Make the fleet driver refuse the servers of worker `label` (or `<node>/label` under
    Ray) with `why` (by default "the server of drafter '<drafter>' on <worker> differs"), as
    a server unlike the journal's would be; every other worker's by the driver's own rule."""
    import dvfs.fleet.driver as driver

    rule = driver.server_refusal

    def refusing(campaign, path, servers, record, pinned, worker):  # type: ignore[no-untyped-def]
        if worker == label or worker.endswith(f"/{label}"):
            return why or f"the server of drafter {record['drafter']!r} on {worker} differs"
        return rule(campaign, path, servers, record, pinned, worker)

    monkeypatch.setattr(driver, "server_refusal", refusing)


def lose_worker_on_its_third_cell(monkeypatch, label: str = "gpu2") -> None:
    """Make the fleet worker `label` raise on its third cell, as a GPU falling off the bus
    would (`Worker.run` patched for the test)."""
    from dvfs.fleet.worker import Worker

    calls = {"n": 0}
    run = Worker.run

    def failing(self: Worker, cell):
        if self.label == label:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("the GPU fell off the bus")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", failing)


def signalled_at(
    argv: list[str], journal: Path, cells: int, sig: int = signal.SIGKILL
) -> tuple[int, str]:
    """Run `argv` (a sweep) and send it `sig` once `journal` holds at least `cells` cells (a
    node lost with SIGKILL: no exit path runs); its return code and output."""
    proc = subprocess.Popen(
        argv,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_dispositions,  # the signal it is sent is not inherited ignored
    )
    try:
        # No deadline of its own: the sweep either writes cells or ends (asserted below); a
        # hang is ended by the test's pytest timeout, whatever the machine's load.
        while not journal.exists() or journal.read_text().count('"type":"cell"') < cells:
            assert proc.poll() is None, f"the sweep ended early: {proc.communicate()[0]}"
            time.sleep(0.01)
        proc.send_signal(sig)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output
