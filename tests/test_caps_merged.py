"""A merged cube of several GPUs is described as all of them, end to end through the CLI:
`headroom --json` names every GPU model and UUID, the report lists every UUID, and caps keyed
by GPU model (the twin's) take each model's own setting, never the first GPU's name."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from cubes import as_twin_sweep, make_cube

from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target
from dvfs.cli import cli
from dvfs.cube import open_cube, write_cube

H100 = "NVIDIA H100 80GB HBM3 (twin)"
H200 = "NVIDIA H200 (twin)"
UUID_A = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
UUID_B = "GPU-bbbbbbbb-0000-4000-8000-000000000002"


def run(*args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def twin_cube(path: Path, name: str, uuid: str, slow_below: int) -> Path:
    """A one-GPU twin cube whose latency keeps within 5% of stock down to `slow_below` MHz,
    where energy is least: so its chosen clock is `slow_below`."""

    def latency(clock: int, *_: object) -> float:
        return 10.0 if clock >= slow_below else 20.0

    ds = make_cube(
        clocks=[1000, 1500, 1980],
        limits=[700.0],
        latency=latency,
        energy=lambda clock, *_: clock / 1000,
    )
    return write_cube(as_twin_sweep(ds, uuid=uuid, gpu_name=name, campaign="merged"), path)


def merged(tmp_path: Path, second: str, second_slow_below: int) -> Path:
    a = twin_cube(tmp_path / "a.nc", H100, UUID_A, 1500)
    b = twin_cube(tmp_path / "b.nc", second, UUID_B, second_slow_below)
    out = tmp_path / "merged.nc"
    run("cube", "merge", str(a), str(b), "-o", str(out))
    return out


@pytest.mark.usefixtures("unsaved_figures")
def test_a_merged_cube_names_every_gpu(tmp_path: Path) -> None:
    cube = merged(tmp_path, H200, 1000)
    room = json.loads(run("headroom", str(cube), "--json").output)
    assert room["gpu"]["name"] == f"{H100}, {H200}"
    assert room["gpu"]["uuids"] == [UUID_A, UUID_B]
    assert room["gpu"]["names"] == {UUID_A: H100, UUID_B: H200}
    markdown = run("headroom", str(cube), "--markdown").output
    assert f"({H100}, {H200})" in markdown

    report = tmp_path / "report.md"
    run("report", str(cube), "-o", str(report))
    text = report.read_text()
    assert f"**GPU UUIDs:** {UUID_A}, {UUID_B}" in text
    # The findings count rows per GPU as such, not as (batch, drafter, corpus) groups.
    assert "of 2 (GPU, batch, drafter, corpus) rows save energy" in text
    caps = text.split("Caps per batch and drafter")[1].split("To write the caps file")[0]
    assert f"every {H100} | 1500 MHz" in caps and f"every {H200} | 1000 MHz" in caps


def test_caps_of_a_merged_twin_cube_are_each_models_own(tmp_path: Path) -> None:
    """Static caps: one [[model]] per GPU model with that model's setting. A per-batch plan
    names one model (`dvfs govern` checks each GPU against it), so two models are refused."""
    saved = tmp_path / "headroom.json"
    run("headroom", str(merged(tmp_path, H200, 1000)), "--json", "-o", str(saved))
    plan = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none")
    caps = tomllib.loads(plan.stdout)
    assert {c["name"]: c["sm_clock_max_mhz"] for c in caps["model"]} == {H100: 1500, H200: 1000}
    assert caps["meta"]["measured_on"] == f"{H100}, {H200}"
    # --model NAME: that model's GPUs only (the H100's less aggressive 1500 MHz took the
    # H200's cap away before), with or without the twin's suffix.
    args = ("cap", "plan", str(saved), "--batch", "1", "--drafter", "none", "--model")
    for name in (H200, H200.removesuffix(" (twin)")):
        (cap,) = tomllib.loads(run(*args, name).stdout)["model"]
        assert (cap["name"], cap["sm_clock_max_mhz"]) == (name, 1000)
    # A model the document never measured is refused in one line naming the ones it did.
    unknown = run(*args, "NVIDIA A100-SXM4-80GB", code=2)
    assert unknown.output.count("\n") == 1 and "A100" in unknown.output
    assert H100 in unknown.output and H200 in unknown.output
    assert not tomllib.loads(run(*args, H100).stdout)["model"][0].get("power_limit_w")

    refused = run("cap", "plan", str(saved), "--per-batch", "--drafter", "none", code=2)
    assert refused.output.count("\n") == 1
    assert f"2 models ({H100}, {H200})" in refused.output


@pytest.mark.parametrize("mode", ["static", "per-batch"])
def test_a_merged_cube_of_one_twin_model_takes_the_least_aggressive(
    tmp_path: Path, mode: str
) -> None:
    """Two twin GPUs of one model: static caps and the per-batch plan agree, each naming that
    model once with the higher of the two GPUs' clocks (static caps refused this before)."""
    saved = tmp_path / "headroom.json"
    run("headroom", str(merged(tmp_path, H100, 1000)), "--json", "-o", str(saved))
    if mode == "static":
        (cap,) = tomllib.loads(
            run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none").stdout
        )["model"]
        assert (cap["name"], cap["sm_clock_max_mhz"]) == (H100, 1500)
    else:
        plan = tomllib.loads(
            run("cap", "plan", str(saved), "--per-batch", "--drafter", "none").stdout
        )
        assert plan["meta"]["measured_on"] == H100
        assert [s["sm_clock_mhz"] for s in plan["batch"]] == [1500]


def test_gpu_names_which_gpus_of_a_merged_document_are_capped(tmp_path: Path) -> None:
    """`--gpu UUID` on a merged document caps that GPU alone, with its own row's setting
    (it capped every measured GPU before, the named one or not); a GPU the document did
    not measure has no setting of its own and is refused in one line naming those it did."""
    saved = tmp_path / "headroom.json"
    run("headroom", str(merged(tmp_path, H200, 1000)), "--json", "-o", str(saved))
    args = ("cap", "plan", str(saved), "--batch", "1", "--drafter", "none")
    for uuid, clock in ((UUID_A, 1500), (UUID_B, 1000)):
        caps = tomllib.loads(run(*args, "--gpu", uuid).stdout)
        assert [(c["uuid"], c["sm_clock_max_mhz"]) for c in caps["gpu"]] == [(uuid, clock)]
    both = tomllib.loads(run(*args, "--gpu", UUID_B, "--gpu", UUID_A).stdout)
    assert {c["uuid"]: c["sm_clock_max_mhz"] for c in both["gpu"]} == {UUID_A: 1500, UUID_B: 1000}
    other = "GPU-cccccccc-0000-4000-8000-000000000003"
    refused = run(*args, "--gpu", other, code=2)
    assert refused.output.count("\n") == 1
    assert other in refused.output and UUID_A in refused.output and UUID_B in refused.output


@pytest.mark.usefixtures("unsaved_figures")
def test_a_gpu_model_at_stock_leaves_the_others_capped(tmp_path: Path) -> None:
    """H100 chooses 1500 MHz, the H200 stock: the caps file caps the H100 and leaves the H200
    out, saying so (the whole plan was refused as "nothing to cap" before, while the report
    told the user to run it); with every model at stock there is still nothing to cap."""
    saved = tmp_path / "headroom.json"
    run("headroom", str(merged(tmp_path, H200, 1980)), "--json", "-o", str(saved))
    plan = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none")
    caps = tomllib.loads(plan.stdout)
    assert [(c["name"], c["sm_clock_max_mhz"]) for c in caps["model"]] == [(H100, 1500)]
    assert f"stock (1980 MHz, 700 W) on {H200}" in caps["meta"]["not_capped"]
    assert "Note: the chosen setting is stock" in " ".join(plan.stderr.split())
    report = tmp_path / "report.md"
    run("report", str(tmp_path / "merged.nc"), "-o", str(report))
    table = report.read_text().split("Caps per batch and drafter")[1]
    assert f"every {H100} | 1500 MHz" in table
    at_stock = tmp_path / "stock"
    at_stock.mkdir()
    both = at_stock / "headroom.json"
    run("headroom", str(merged(at_stock, H100, 1980)), "--json", "-o", str(both))
    refused = run("cap", "plan", str(both), "--batch", "1", "--drafter", "none", code=2)
    assert "nothing to cap" in refused.output and refused.output.count("\n") == 1


def test_a_stock_limit_that_differs_across_merged_gpus_was_not_swept(tmp_path: Path) -> None:
    """Each GPU ran at its own stock power limit (700 and 600 W), so the merged axis holds
    two limits, one in each GPU's grid. Each GPU's headroom read both as its grid: a power
    headroom of `≥0` W (a lower bound, "extend knobs.power_limit downward"), its chosen 1500
    MHz (above the grid's 1000) at the grid's edge, and a caps file noting `grid_edge`. Each
    cube alone says the power limit was not swept, and no edge: so must the merge."""
    cubes = []
    for path, name, uuid, watts in (("a.nc", H100, UUID_A, 700.0), ("b.nc", H200, UUID_B, 600.0)):
        ds = make_cube(
            clocks=[1000, 1500, 1980],
            limits=[watts],
            latency=lambda clock, *_: 10.0 if clock >= 1500 else 20.0,
            energy=lambda clock, *_: clock / 1000,
        )
        cubes.append(
            write_cube(as_twin_sweep(ds, uuid=uuid, gpu_name=name, campaign="m"), tmp_path / path)
        )
    out = tmp_path / "merged.nc"
    run("cube", "merge", *map(str, cubes), "-o", str(out))
    saved = tmp_path / "headroom.json"
    doc = json.loads(run("headroom", str(out), "--slack", "5%", "--json", "-o", str(saved)).stdout)
    assert doc["swept"] == {"sm_clock": True, "power_limit": False}
    rows = doc["rows"]
    assert [(r["chosen"]["sm_clock_mhz"], r["headroom_mhz"]) for r in rows] == [(1500, 480)] * 2
    assert [r["headroom_w"] for r in rows] == [None, None]
    assert not any(r["at_grid_edge"] or r["chosen_at_grid_edge"] for r in rows)
    said = " ".join(run("headroom", str(out), "--slack", "5%").stdout.split())
    assert "≥" not in said and "not swept: the cube has one power limit" in said
    caps = tomllib.loads(run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none").stdout)
    capped = [(c["name"], c["sm_clock_max_mhz"]) for c in caps["model"]]
    assert capped == [(H100, 1500), (H200, 1500)]
    assert "grid_edge" not in caps["meta"]


def test_compare_marks_the_grid_edge_on_each_gpu_of_other_stock_limits(tmp_path: Path) -> None:
    """Each GPU ran at its own stock power limit (700 and 600 W); the drafter, twice as fast,
    meets the baseline's latency at the grid's lowest clock. Its cube alone marks that ratio
    `(grid edge)` on either GPU; in the merge, the 700 W GPU's took the other GPU's 600 W for
    a setting of its own not measured yet, below its answer, and marked no edge."""
    cubes = []
    for path, name, uuid, watts in (("a.nc", H100, UUID_A, 700.0), ("b.nc", H200, UUID_B, 600.0)):
        ds = make_cube(
            clocks=[1000, 1500, 1980],
            limits=[watts],
            drafters=["none", "eagle3"],
            latency=lambda clock, _p, _b, drafter, *_: (
                (5.0 if drafter == "eagle3" else 10.0) * 1980 / clock
            ),
            energy=lambda clock, *_: clock / 1000,
        )
        cubes.append(
            write_cube(as_twin_sweep(ds, uuid=uuid, gpu_name=name, campaign="m"), tmp_path / path)
        )
    out = tmp_path / "merged.nc"
    run("cube", "merge", *map(str, cubes), "-o", str(out))
    for cube in (*cubes, out):
        result = run("compare", str(cube), "--json")
        rows = json.loads(result.stdout)["rows"]
        assert [r["equal_latency_drafter_at_grid_edge"] for r in rows] == [True] * len(rows)
    said = " ".join(run("compare", str(out)).stdout.split())
    assert "grid edge: in 2 of 2 rows" in said, said


def mixed_references(tmp_path: Path) -> Path:
    """Two GPUs swept over one grid of power limits, 700 and 400 W: the first's stock limit
    (700 W) is on it, the second's (600 W, an operator's) is not. Each GPU's reference is its
    own: the first's stock setting, the second's the top of the grid."""
    cubes = []
    for path, name, uuid, stock in (("a.nc", H100, UUID_A, 700.0), ("b.nc", H200, UUID_B, 600.0)):
        ds = make_cube(
            clocks=[1000, 1500, 1980],
            limits=[400.0, 700.0],
            batches=[1, 4],
            latency=lambda clock, *_: 10.0 if clock >= 1500 else 20.0,
            energy=lambda clock, limit, *_: clock / 1000 + limit / 1000,
            stock_limit=stock,
        )
        cubes.append(
            write_cube(as_twin_sweep(ds, uuid=uuid, gpu_name=name, campaign="m"), tmp_path / path)
        )
    out = tmp_path / "merged.nc"
    run("cube", "merge", *map(str, cubes), "-o", str(out))
    return out


def test_merged_gpus_one_at_stock_one_at_the_top_of_the_grid(tmp_path: Path) -> None:
    """Each GPU's headroom described the target against its own reference ("stock" for the
    first, "top-of-grid" for the second); the merge dropped the two descriptions that differ,
    and `dvfs headroom` (so `report` and `cap plan`) failed with an internal KeyError 'target'.
    The target is now said against each GPU's reference, which the document gives per GPU."""
    merged = mixed_references(tmp_path)
    doc = json.loads(run("headroom", str(merged), "--slack", "5%", "--json").stdout)
    said = "TPOT p50 <= each drafter's own reference TPOT p50 + 5%"
    assert doc["target"]["description"] == said
    with open_cube(merged) as cube:  # and the Python API's result says it as the CLI does
        assert headroom(cube, target=Target(slack=0.05)).attrs["target"] == said
    per_gpu = doc["reference"]["per_gpu"]
    assert [per_gpu[u]["is_stock"] for u in (UUID_A, UUID_B)] == [True, False]
    assert [(r["chosen"]["sm_clock_mhz"], r["chosen"]["power_limit_w"]) for r in doc["rows"]] == [
        (1500, 400.0)
    ] * 4


def test_merged_gpus_of_two_reference_kinds_are_each_said_as_their_own(tmp_path: Path) -> None:
    """The same merge: both GPUs' references are at 1980 MHz / 700 W, the first's its stock
    setting, the second's the top of the grid. The reference line said "top of the grid" for
    both (its setting alike, its kind taken as not stock), the report's findings "below the top
    of the grid" and every figure's caption "at the reference (top of the grid)", the first
    GPU's too. Each GPU is now said as its own, its figures captioned by its own reference."""
    merged = mixed_references(tmp_path)
    said = " ".join(run("headroom", str(merged), "--slack", "5%").stdout.split())
    assert (
        "reference: each GPU's own: GPU-aaaaaaaa stock (1980 MHz / 700 W), GPU-bbbbbbbb 1980 MHz "
        "(stock) / 700 W (top of the grid; stock 600 W not swept)"
    ) in said
    report = tmp_path / "report.md"
    run("report", str(merged), "--slack", "5%", "-o", str(report))
    text = report.read_text()
    assert "below each GPU's reference while meeting" in text
    assert "below the top of the grid" not in text
    captions = [line for line in text.splitlines() if line.startswith("*GPU ")]
    h100 = [c for c in captions if "GPU-aaaaaaaa" in c and "batch size at" in c]
    h200 = [c for c in captions if "GPU-bbbbbbbb" in c and "batch size at" in c]
    assert h100 and all("at the stock setting" in c for c in h100)
    assert h200 and all("at the reference (top of the grid)" in c for c in h200)


def test_a_gpu_whose_stock_clock_tops_no_other_is_referenced_on_its_own_grid(
    tmp_path: Path,
) -> None:
    """The campaign left the SM clock at stock (1980 and 1755 MHz) and swept power limits that
    hold neither GPU's stock limit: each GPU's reference is the top of its own grid, the second's
    1755 MHz / 500 W. In the merge its reference was 1980 MHz, the merged axis's top (the
    other GPU's stock clock, where it has no cell): "no valid reference cell (not measured
    yet)" where its own cube answers, and `cube info` gave it that reference too."""
    campaign = {
        "name": "m",
        "knobs": {"sm_clocks_mhz": None, "power_limits_w": [400.0, 500.0]},
        "workload": {"batch_sizes": [1], "corpora": [{"name": "code"}]},
        "measurement": {"repeats": 2},
        "drafters": [{"name": "none"}],
        "engine": {"model": "m", "tp_size": 1},
        "gpu": {},
    }
    cubes = []
    for path, name, uuid, mhz, watts in (
        ("a.nc", H100, UUID_A, 1980, 700.0),
        ("b.nc", H200, UUID_B, 1755, 600.0),
    ):
        ds = make_cube(
            clocks=[mhz],
            limits=[400.0, 500.0],
            repeats=2,
            latency=lambda _clock, limit, *_: 10.0 if limit >= 500 else 10.2,
            energy=lambda _clock, limit, *_: limit / 500,
            stock_clock=mhz,
            stock_limit=watts,
        )
        ds = as_twin_sweep(ds, uuid=uuid, gpu_name=name, campaign="m")
        cubes.append(write_cube(ds.assign_attrs(campaign=json.dumps(campaign)), tmp_path / path))
    out = tmp_path / "merged.nc"
    run("cube", "merge", *map(str, cubes), "-o", str(out))
    doc = json.loads(run("headroom", str(out), "--slack", "5%", "--json").stdout)
    per_gpu = doc["reference"]["per_gpu"]
    assert [
        (per_gpu[u]["sm_clock_mhz"], per_gpu[u]["power_limit_w"]) for u in (UUID_A, UUID_B)
    ] == [
        (1980, 500.0),
        (1755, 500.0),
    ]
    for cube, row in zip(cubes, doc["rows"], strict=True):
        (own,) = json.loads(run("headroom", str(cube), "--slack", "5%", "--json").stdout)["rows"]
        assert row["chosen"] == own["chosen"] and row["headroom_w"] == own["headroom_w"] == 100
    info = " ".join(run("cube", "info", str(out)).stdout.split())
    assert "GPU-bbbbbbbb 1755 MHz (stock) / 500 W (top of the grid; stock 600 W not swept)" in info


def test_a_gpu_that_did_not_sweep_its_stock_limit_is_referenced_on_its_own_grid(
    tmp_path: Path,
) -> None:
    """GPU A swept 300 and 600 W, GPU B 300, 600 and 700 W, both of stock 700 W. The merged
    axis holds 700 W (B's), so A's stock limit looked swept: its reference was 700 W, where
    it has no cell, and headroom gave it "no valid reference cell (not measured yet)". Each
    GPU's reference is now from its own grid (A's 1980 MHz / 600 W, the top of it), its answer
    its own cube's, and A's cells at 700 W are not counted as waiting to be measured."""
    cubes = []
    for path, uuid, limits in (
        ("a.nc", UUID_A, [300.0, 600.0]),
        ("b.nc", UUID_B, [300.0, 600.0, 700.0]),
    ):
        ds = make_cube(
            clocks=[1500, 1980],
            limits=limits,
            repeats=2,
            latency=lambda clock, *_: 10.0 * 1980 / clock,
            energy=lambda clock, limit, *_: clock / 1000 + limit / 1000,
            stock_clock=1980,
            stock_limit=700.0,
        )
        ds = as_twin_sweep(ds, uuid=uuid, gpu_name=H100, campaign="m")
        cubes.append(write_cube(ds, tmp_path / path))
    out = tmp_path / "merged.nc"
    run("cube", "merge", *map(str, cubes), "-o", str(out))
    doc = json.loads(run("headroom", str(out), "--slack", "30%", "--json").stdout)
    per_gpu = doc["reference"]["per_gpu"]
    assert [
        (per_gpu[u]["sm_clock_mhz"], per_gpu[u]["power_limit_w"], per_gpu[u]["is_stock"])
        for u in (UUID_A, UUID_B)
    ] == [(1980, 600.0, False), (1980, 700.0, True)]
    for cube, row in zip(cubes, doc["rows"], strict=True):
        (own,) = json.loads(run("headroom", str(cube), "--slack", "30%", "--json").stdout)["rows"]
        assert row["chosen"] == own["chosen"] is not None
        assert row["headroom_w"] == own["headroom_w"]
    said = " ".join(run("headroom", str(out), "--slack", "30%").stdout.split())
    assert "not measured yet" not in said and "partial cube" not in said, said
