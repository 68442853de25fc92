"""Known answers for the speculation comparison and the roofline annotation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cubes import make_cube

from dvfs.analysis.compare import (
    LOSES,
    NO_DATA,
    NOT_WITHIN,
    SAVES,
    break_even_summary,
    compare,
)
from dvfs.analysis.roofline import roofline
from dvfs.errors import AnalysisError
from dvfs.twin.fit import achievable_ridge_point
from dvfs.twin.profiles import gpu_profile

CLOCKS = [1000, 2000]
BATCHES = [1, 8, 64]
# Energy per token at (drafter, batch, clock). EAGLE-3 saves at small batch and loses at 64.
ENERGY = {
    ("none", 1, 2000): 1.0,
    ("none", 8, 2000): 0.2,
    ("none", 64, 2000): 0.04,
    ("none", 1, 1000): 0.8,
    ("none", 8, 1000): 0.16,
    ("none", 64, 1000): 0.035,
    ("eagle3", 1, 2000): 0.4,
    ("eagle3", 8, 2000): 0.15,
    ("eagle3", 64, 2000): 0.05,
    ("eagle3", 1, 1000): 0.3,
    ("eagle3", 8, 1000): 0.10,
    ("eagle3", 64, 1000): 0.06,
}
# TPOT: none 10 ms at stock, 12 ms at 1000 MHz; EAGLE-3 4 / 6 ms at small batch, 9 / 15 at 64.
LATENCY = {
    ("none", 2000): 10.0,
    ("none", 1000): 12.0,
    ("eagle3", 2000): 4.0,
    ("eagle3", 1000): 6.0,
}


def cube():
    def latency(c, p, b, d, *_):
        if d == "eagle3" and b == 64:
            return {2000: 9.0, 1000: 15.0}[c]
        return LATENCY[(d, c)]

    return make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        latency=latency,
        energy=lambda c, p, b, d, *_: ENERGY[(d, b, c)],
    )


def test_equal_clock_and_equal_latency_ratios() -> None:
    result = compare(cube())
    at = result.sel(drafter="eagle3", corpus="code")
    np.testing.assert_allclose(at["energy_ratio_at_stock"].values, [0.4, 0.75, 1.25])
    # Equal latency: EAGLE-3 may drop to 1000 MHz (6 ms <= none's 10 ms); none stays at stock.
    np.testing.assert_allclose(
        at["energy_ratio_equal_latency"].sel(batch=[1, 8]).values, [0.3 / 1.0, 0.10 / 0.2]
    )
    # At batch 64 EAGLE-3 is still faster at stock (9 ms) but only stock qualifies: 0.05 / 0.04.
    assert float(at["energy_ratio_equal_latency"].sel(batch=64)) == pytest.approx(1.25)


def test_break_even_batch() -> None:
    result = compare(cube())
    at = result.sel(drafter="eagle3", corpus="code")
    assert int(at["break_even_batch_equal_clock"]) == 64
    assert int(at["break_even_batch_equal_latency"]) == 64
    never = compare(
        make_cube(
            clocks=CLOCKS,
            batches=BATCHES,
            drafters=["none", "eagle3"],
            energy=lambda c, p, b, d, *_: 0.5 if d == "eagle3" else 1.0,
        )
    )
    assert math.isnan(
        float(never.sel(drafter="eagle3", corpus="code")["break_even_batch_equal_clock"])
    )


def test_break_even_batch_is_the_smallest_whatever_the_campaigns_batch_order() -> None:
    """A campaign may list its batches in any order (`batch = [64, 1, 8]`) and the cube keeps
    it: the break-even batch is still the smallest batch that stops saving, as its summary
    says ("saves up to batch 1"), not the first one on the axis."""

    def energy(c, p, b, d, *_):
        return (0.5 if b == 1 else 1.5) if d == "eagle3" else 1.0

    for batches in ([1, 8, 64], [64, 1, 8], [8, 64, 1]):
        result = compare(
            make_cube(clocks=CLOCKS, batches=batches, drafters=["none", "eagle3"], energy=energy)
        ).sel(drafter="eagle3", corpus="code")
        assert str(result["break_even_equal_clock"].values) == "saves up to batch 1"
        assert int(result["break_even_batch_equal_clock"]) == 8, batches
        assert int(result["break_even_batch_equal_latency"]) == 8, batches


def test_a_ratio_at_equal_latency_at_the_grids_lowest_setting_says_so() -> None:
    """EAGLE-3 meets none's stock latency at the lowest clock swept at batches 1 and 8 (a lower
    one might spend less: its ratio is no final answer), at batch 64 only at stock."""
    from dvfs.report import compare_document, compare_notes, compare_tables

    ds = cube()
    result = compare(ds)
    doc = compare_document(result, None, ds)
    edge = {r["batch"]: r["equal_latency_drafter_at_grid_edge"] for r in doc["rows"]}
    assert edge == {1: True, 8: True, 64: False}
    assert not any(r["equal_latency_baseline_at_grid_edge"] for r in doc["rows"])
    [(_, header, rows), *_] = compare_tables(doc)
    cells = {row[0]: row[header.index("at equal latency (TPOT p50)")] for row in rows}
    assert cells["1"].endswith("(grid edge)") and cells["8"].endswith("(grid edge)")
    assert "grid edge" not in cells["64"]
    [note] = [n for n in compare_notes(doc) if n.startswith("grid edge:")]
    assert "in 2 of 3 rows" in note and "extend knobs.sm_clock" in note


def test_compare_needs_the_baseline() -> None:
    with pytest.raises(AnalysisError, match="baseline drafter 'none' is not in the cube"):
        compare(make_cube(clocks=CLOCKS, drafters=["eagle3"]))


def roofline_cube(width: int, clocks: tuple[int, ...] = (705, 1005, 1500, 1980)):
    ds = make_cube(clocks=list(clocks), batches=[1, 16, 64], drafters=["none", "eagle3"])
    ds.attrs.update(
        model="meta-llama/Llama-3.1-8B-Instruct",
        gpu_name="NVIDIA H100 80GB HBM3",
        tp_size=1,
        server_args=json.dumps(
            {
                "none": {"args": {"speculative_algorithm": None}},
                "eagle3": {
                    "args": {
                        "speculative_algorithm": "EAGLE3",
                        "speculative_num_draft_tokens": width,
                    }
                },
            }
        ),
        campaign=json.dumps({"workload": {"input_tokens": [64, 64], "output_tokens": 64}}),
    )
    return ds


def test_roofline_marks_where_verification_turns_compute_bound() -> None:
    roof = roofline(roofline_cube(8))
    h100 = gpu_profile("h100-sxm")
    # The twin's achievable ridge (efficiencies and bandwidth knee applied), not the datasheet's.
    np.testing.assert_allclose(
        roof["ridge_point"].values,
        [achievable_ridge_point(h100, c) for c in (705, 1005, 1500, 1980)],
    )
    assert roof.attrs["context_tokens"] == 96
    ai = roof["arithmetic_intensity"]
    # Decode without speculation reads all weights for B tokens: intensity ~ B FLOP/byte.
    assert float(ai.sel(batch=1, drafter="none")) == pytest.approx(1.0, rel=0.05)
    assert float(ai.sel(batch=64, drafter="eagle3")) > float(ai.sel(batch=64, drafter="none"))
    assert int(roof["verify_tokens"].sel(batch=64, drafter="eagle3")) == 512
    bound = roof["compute_bound"]
    assert not bound.sel(drafter="none").any()
    # 512 verified tokens at batch 64 exceed the ridge at every clock; at batch 16 (128 tokens)
    # only at low clocks, where the ridge point has fallen.
    assert bound.sel(batch=64, drafter="eagle3").all()
    low = bound.sel(batch=16, drafter="eagle3")
    assert bool(low.sel(sm_clock=705)) and not bool(low.sel(sm_clock=1980))


def test_the_roofline_json_and_table_give_the_ridge_each_pass_is_held_against() -> None:
    """A pass of few tokens is compute-bound below the full GEMM's ridge (its tiles and waves
    part-filled): the row gives the ridge its clock rests on, so a reader re-deriving
    `compute_bound_below_mhz` from the document gets the same clock, and the table never
    shows a pass below every ridge in sight as compute-bound."""
    from dvfs.report import compare_document, compare_tables

    ds = roofline_cube(8)
    doc = compare_document(compare(ds), roofline(ds), ds)
    lowered = 0
    for v in doc["roofline"]["verify"]:
        ridge = v["verify_ridge_point"]
        assert set(ridge) == set(doc["roofline"]["ridge_point"])
        past = [int(c) for c, r in ridge.items() if v["arithmetic_intensity"] > r]
        assert v["compute_bound_below_mhz"] == (max(past) if past else None), v
        lowered += any(r < doc["roofline"]["ridge_point"][c] for c, r in ridge.items())
    assert lowered  # the few-token passes' ridge is below the full GEMM's
    (title, header, rows) = compare_tables(doc)[-1]
    column = header.index("its ridge FLOP/B")
    for v, row in zip(doc["roofline"]["verify"], rows, strict=True):
        low, high = min(v["verify_ridge_point"].values()), max(v["verify_ridge_point"].values())
        assert row[column] == f"{low:.0f}-{high:.0f}", row


def test_the_roofline_title_of_a_cube_of_one_clock_gives_its_one_ridge() -> None:
    """One SM clock (a power-limit-only grid): the title gives that clock's ridge once, not a
    range from a figure to itself; several clocks still give the range."""
    from dvfs.report import compare_document, compare_tables

    titles = {}
    for clocks in ((1980,), (705, 1980)):
        ds = roofline_cube(8, clocks)
        doc = compare_document(compare(ds), roofline(ds), ds)
        ridges = [round(r) for r in doc["roofline"]["ridge_point"].values()]
        titles[clocks] = (compare_tables(doc)[-1][0], ridges)
    one, (low, high) = titles[(1980,)][0], sorted(titles[(705, 1980)][1])
    assert f"ridge {titles[(1980,)][1][0]} FLOP/B at its one clock" in one, one
    assert f"{titles[(1980,)][1][0]}-" not in one
    assert f"ridge {low}-{high} FLOP/B over the clocks" in titles[(705, 1980)][0]


def _drawn_context(ds) -> float:
    """The mean input tokens of the prompts a fixed-batch cube's cells were sent (each measured
    cell's rounds drawn again as the sweep draws them), per corpus, then over the corpora,
    plus half the output: what the roofline's context should be."""
    from dvfs.corpora import load_corpus
    from dvfs.corpora.sampling import sample_prompts
    from dvfs.cube import STATUS_OK

    workload = json.loads(ds.attrs["campaign"])["workload"]
    seed = json.loads(ds.attrs["campaign"])["measurement"]["seed"]
    per_corpus = []
    for name in map(str, ds["corpus"].values):
        corpus, cells = load_corpus(name), []
        at = ds.sel(corpus=name).stack(cell=[d for d in ds["cell_status"].dims if d != "corpus"])
        for i in range(at.sizes["cell"]):
            cell = at.isel(cell=i)
            if int(cell["cell_status"]) != STATUS_OK:
                continue
            batch, repeat = int(cell["batch"]), int(cell["repeat"])
            lengths = [
                p.input_tokens
                for label in range(int(cell["rounds"]))
                for p in sample_prompts(
                    corpus,
                    batch,
                    input_tokens=tuple(workload["input_tokens"]),
                    seed=seed,
                    key=(batch, repeat, label),
                )
            ]
            cells.append(np.mean(lengths))
        per_corpus.append(np.mean(cells))
    return float(np.mean(per_corpus)) + workload["output_tokens"] / 2


def test_the_roofline_reads_the_kv_cache_of_the_prompts_the_sweep_drew(small_sweep) -> None:
    """The input_tokens range (16-2048) only bounds the prompts, which average 150-200 tokens
    in the built-in corpora: the roofline's context is the mean of those the sweep sent (plus
    half the output), which each cell records (`prompt_tokens`), not the range's middle, which
    overstated the KV cache read, nor the mean of every prompt the corpus could have given
    (those drawn are a sample of it). A cube that does not record them (an earlier dvfs's)
    falls back to the middle, said in a note: the analysis reads no corpus."""
    from dvfs.corpora import load_corpus
    from dvfs.corpora.sampling import eligible_prompts
    from dvfs.cube import open_cube

    ds = open_cube(small_sweep)
    notes: list[str] = []
    roof = roofline(ds, notes=notes)
    assert roof.attrs["context_tokens"] == pytest.approx(_drawn_context(ds), rel=1e-12)
    assert notes == []
    pool = np.mean(
        [
            np.mean([p.input_tokens for p in eligible_prompts(load_corpus(name), (16, 2048))])
            for name in ("code", "conversation")
        ]
    )
    assert roof.attrs["context_tokens"] != pytest.approx(pool + 64 / 2)
    assert "context_note" not in roof.attrs
    older = ds.drop_vars("prompt_tokens")  # a cube of a dvfs that did not record them
    roof = roofline(older, notes=notes)
    assert roof.attrs["context_tokens"] == (16 + 2048) / 2 + 64 / 2
    [note] = notes
    assert note.startswith("roofline context:") and "1032 tokens" in note, note
    assert "does not record" in note and "\n" not in note
    # the accessor, which takes no notes, says it in the result
    import dvfs.accessor  # noqa: F401  (registers ds.dvfs)

    assert older.dvfs.roofline().attrs["context_note"] == note


def test_an_older_cube_reads_its_corpora_again_at_the_edge(small_sweep, tmp_path) -> None:
    """A cube of an earlier dvfs (no `prompt_tokens`): `dvfs compare` reads the prompts its
    sweep drew from again, from the campaign's corpora, as it did before the cube recorded
    them (the mean of each corpus's prompts within the input range), with no note; a cube
    recording them is given nothing (the analysis reads its record)."""
    from dvfs.corpora import load_corpus
    from dvfs.corpora.sampling import eligible_prompts
    from dvfs.cube import open_cube, write_cube
    from dvfs.cube.prompts import roofline_context

    ds = open_cube(small_sweep)
    notes: list[str] = []
    assert roofline_context(ds, small_sweep, notes) is None and notes == []
    older = ds.drop_vars("prompt_tokens")
    means = [
        np.mean([p.input_tokens for p in eligible_prompts(load_corpus(name), (16, 2048))])
        for name in ("code", "conversation")
    ]
    context = roofline_context(older, small_sweep, notes)
    assert context == pytest.approx(np.mean(means) + 64 / 2) and notes == []
    write_cube(older, tmp_path / "older.nc")
    doc = _compare_json(tmp_path / "older.nc")
    assert doc["roofline"]["context_tokens"] == pytest.approx(context)


def _report_text(cube, out) -> str:
    """`dvfs report CUBE -o OUT` (Markdown)'s text, on one line."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    result = CliRunner().invoke(cli, ["report", str(cube), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return " ".join(out.read_text().split())


def _compare_json(cube) -> dict:
    """`dvfs compare CUBE --json`'s document, and what it said on stderr (as "stderr")."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    result = CliRunner().invoke(cli, ["compare", str(cube), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout) | {"stderr": result.stderr}


def test_a_merged_cube_reads_the_context_of_its_campaigns_prompts(tiny_exact_run) -> None:
    """The same campaign swept on a fleet of an H100 and an H200 (a merged cube) reads the
    context of the prompts it drew, as its one-GPU sweep does, not the middle of input_tokens:
    the merge keeps the campaign file all its cubes were swept from."""
    from dvfs.analysis.roofline import rooflines
    from dvfs.cube import open_cube

    one = roofline(open_cube(tiny_exact_run("one")))
    notes: list[str] = []
    merged = rooflines(open_cube(tiny_exact_run("mixed")), notes=notes)
    assert [r.attrs["context_tokens"] for r in merged] == [one.attrs["context_tokens"]] * 2
    assert notes == []


def _swept_with_own_corpus(folder) -> tuple:
    """TINY_EXACT on the built-in code and a corpus file of its own, swept into FOLDER/out:
    the cube's folder and the corpus file."""
    from conftest import TINY_EXACT, _swept, replace_block, write

    rows = [{"text": f"prompt {i}: " + "tell me about the sea " * (5 + i % 40)} for i in range(60)]
    corpus = write(folder / "data" / "mine.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    text = replace_block(TINY_EXACT, 'corpora = ["code"]', 'corpora = ["code", "mine"]')
    text += '\n[corpus.mine]\npath = "data/mine.jsonl"\nfield = "text"\n'
    _swept(write(folder / "campaign.toml", text), folder / "out")
    return folder / "out", corpus


def test_the_roofline_context_note_says_why_the_prompts_cannot_be_read(
    tmp_path, monkeypatch
) -> None:
    """A corpus file edited since the sweep, the tokenizer the cube says counted its prompts
    gone, the corpus file deleted, then (in the campaign) a Hugging Face dataset: the middle of
    input_tokens stands in, and the note says which corpus and why (changed, no tokenizer,
    missing, a dataset not fetched again for an analysis), never "put the corpora back where
    they were" for one that is where it was; an analysis never loads a hub dataset. Of a cube
    that does not record what its cells sent (an earlier dvfs's), which `dvfs compare` and
    `dvfs report` read again from its corpora (`roofline_context`)."""
    import sys
    import types

    from dvfs.cube import open_cube
    from dvfs.cube.prompts import roofline_context

    out, corpus = _swept_with_own_corpus(tmp_path)
    ds = open_cube(out).drop_vars("prompt_tokens")
    notes: list[str] = []
    drawn = roofline_context(ds, out, notes)
    assert notes == [] and drawn != (16 + 2048) / 2 + 64 / 2

    def note_of(cube) -> str:
        notes: list[str] = []
        assert roofline_context(cube, out, notes) == (16 + 2048) / 2 + 64 / 2
        [note] = notes
        assert note.startswith("roofline context:") and "1032 tokens" in note, note
        return note

    with corpus.open("a") as f:
        f.write(json.dumps({"text": "one prompt more"}) + "\n")
    edited = note_of(ds)
    assert "corpus 'mine' has changed" in edited and "back where they were" not in edited
    tokenized = ds.copy()
    tokenized.attrs["token_count_method"] = "tokenizer of meta-llama/Llama-3.1-8B-Instruct"
    monkeypatch.setattr("dvfs.corpora.tokens.load_tokenizer", lambda model: None)
    assert "tokenizer of meta-llama/Llama-3.1-8B-Instruct, not in the local cache" in note_of(
        tokenized
    )
    moved = ds.copy()
    moved.attrs["campaign_dir"] = str(tmp_path / "moved")
    gone = note_of(moved)
    assert "moved, where the relative paths of its corpora start" in gone and "fit" not in gone
    corpus.unlink()
    assert str(corpus) in note_of(ds)
    loaded = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, **k: loaded.append(a)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    hub = ds.copy()
    hub.attrs["campaign_source"] = ds.attrs["campaign_source"].replace(
        'path = "data/mine.jsonl"', 'dataset = "acme/prompts"'
    )
    assert "corpus 'mine' is a Hugging Face dataset" in note_of(hub)
    assert loaded == []


@pytest.mark.usefixtures("unsaved_figures")
def test_compare_reads_the_context_the_cube_records_not_the_corpus_file(
    tmp_path, monkeypatch
) -> None:
    """The roofline's context is what the sweep recorded its cells sent: `dvfs compare` gives
    the same roofline rows, with nothing said, once the corpus file is gone (it read every
    corpus whole again, each run: an 87 MB one took 1.7 s and ~490 MB, and a corpus moved or
    deleted after the sweep put the middle of the input range in its place), and from another
    working directory; `dvfs report` too. A cube of an earlier dvfs (no `prompt_tokens`) still
    reads the corpus again; where it is gone, one line says the middle stands in and why."""
    from dvfs.cube import open_cube, write_cube

    out, corpus = _swept_with_own_corpus(tmp_path)
    before = _compare_json(out)
    assert "roofline context" not in before["stderr"]
    moved = corpus.rename(corpus.with_suffix(".moved"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    after = _compare_json(out)
    assert after["roofline"] == before["roofline"]
    assert "roofline context" not in after["stderr"]
    older = tmp_path / "older.nc"
    write_cube(open_cube(out).drop_vars("prompt_tokens"), older)
    gone = _compare_json(older)
    assert gone["roofline"]["context_tokens"] == (16 + 2048) / 2 + 64 / 2
    [said] = [line for line in gone["stderr"].splitlines() if "roofline context" in line]
    assert str(corpus) in said, gone["stderr"]
    # the report alike: nothing to say of the cube that records its prompts, the older one's
    # context said in its notes
    assert "Roofline context" not in _report_text(out, tmp_path / "new.md")
    note = _report_text(older, tmp_path / "older.md").split("Roofline context")[1]
    assert "mine.jsonl does not exist" in note, note  # (Markdown escapes the path's _)
    moved.rename(corpus)
    reread = _compare_json(older)
    assert reread["roofline"]["context_tokens"] != gone["roofline"]["context_tokens"]
    assert "roofline context" not in reread["stderr"]


def test_roofline_needs_a_known_model() -> None:
    ds = roofline_cube(8)
    ds.attrs["model"] = "acme/unknown-model"
    with pytest.raises(AnalysisError, match="twin_model"):
        roofline(ds)


@pytest.mark.parametrize(
    "gpu_name",
    [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA H100 PCIe",
        "NVIDIA H20",
        "NVIDIA GH200 480GB",
        "NVIDIA H200 NVL",
    ],
)
def test_a_gpu_the_twin_has_no_profile_of_gets_no_twin_ridge(gpu_name: str) -> None:
    """The twin's ridge points are its profiles' GPUs': a cube of another GPU got the H100
    SXM's under its own name (an A100, an H100 PCIe), or the H200 SXM's (an H20, whose name is
    a prefix of the H200's; an H200 NVL, 600 W and its own clocks, whose name holds it). The
    roofline says what to measure instead; a measured one is used."""
    ds = roofline_cube(8)
    ds.attrs["gpu_name"] = gpu_name
    with pytest.raises(AnalysisError, match=r"no profile of the cube's GPU \(.*dvfs gpu roofline"):
        roofline(ds)
    for known, key in (("NVIDIA H200", "h200-sxm"), ("NVIDIA H100 80GB HBM3 (twin)", "h100-sxm")):
        ds.attrs["gpu_name"] = known
        assert roofline(ds).attrs["gpu_profile"] == key
    # a twin's own profile
    ds.attrs.update(gpu_name=gpu_name, twin_profile="h200-sxm:none", gpu_backend="twin")
    assert roofline(ds).attrs["gpu_profile"] == "h200-sxm"


@pytest.mark.parametrize("gpu_name", ["NVIDIA L40S", "NVIDIA H20", "NVIDIA A100-SXM4-80GB"])
def test_a_measured_roofline_of_a_gpu_the_twin_has_no_profile_of_uses_no_other_gpus_curve(
    gpu_name: str,
) -> None:
    """`compare --roofline FILE` on a cube of a GPU the twin has no profile of (what the
    roofline's refusal tells its user to do) said `gpu_profile: h100-sxm` and set each verify
    pass against the measured ridge lowered by the H100's GEMM tiles and waves: the H100's
    figures under the L40S's name. It names no profile now, sets the passes against the
    measured ridge itself, and says in one note what that means; a GPU the twin has a profile
    of keeps its own curve."""
    import xarray as xr

    from dvfs.report import compare_document

    def measured(name: str) -> xr.Dataset:
        return xr.Dataset(
            {"sm_clock_mhz": ("setting", [1980.0, 705.0]), "ridge_point": ("setting", [300, 110])},
            attrs={"gpu_name": name},
        )

    ds = roofline_cube(8)
    ds.attrs.update(gpu_name=gpu_name, gpu_backend="nvml", twin_profile="h100-sxm")
    roof = roofline(ds, measured=measured(gpu_name))
    assert roof.attrs["gpu_profile"] is None
    assert compare_document(compare(ds), roof, ds)["roofline"]["gpu_profile"] is None
    ridge = roof["ridge_point"].broadcast_like(roof["verify_ridge_point"])
    np.testing.assert_array_equal(roof["verify_ridge_point"].values, ridge.values)
    np.testing.assert_array_equal(
        roof["compute_bound"].values, (roof["arithmetic_intensity"] > ridge).values
    )
    notes: list[str] = []
    roofline(ds, measured=measured(gpu_name), notes=notes)
    [note] = notes
    assert f"no profile of {gpu_name}" in note and "estimates" in note, note
    assert gpu_name in roof.attrs["ridge"]
    # the H100 SXM's own measured roofline: its tiles and waves lower a pass of 8 tokens' ridge
    ds.attrs["gpu_name"] = "NVIDIA H100 80GB HBM3"
    notes = []
    roof = roofline(ds, measured=measured("NVIDIA H100 80GB HBM3"), notes=notes)
    assert roof.attrs["gpu_profile"] == "h100-sxm" and notes == []
    at = {"batch": 1, "drafter": "eagle3"}
    assert (roof["verify_ridge_point"].sel(at) < roof["ridge_point"]).all()


def test_a_real_gpus_campaign_twin_is_not_its_model() -> None:
    """A hardware campaign's `gpu.profile` (the twin that estimates its time) is recorded as
    the cube's `twin_profile`: an H200 swept with `gpu.profile = "h100-sxm"` got the H100's
    ridge points, and an A100 the H100's under its own name. A real GPU is its NVML name's."""
    ds = roofline_cube(8)
    ds.attrs.update(gpu_backend="nvml", gpu_name="NVIDIA H200", twin_profile="h100-sxm")
    assert roofline(ds).attrs["gpu_profile"] == "h200-sxm"
    ds.attrs["gpu_name"] = "NVIDIA A100-SXM4-80GB"
    with pytest.raises(AnalysisError, match=r"no profile of the cube's GPU \(NVIDIA A100"):
        roofline(ds)
    # a twin's cube keeps its own profile; one lent from a file, no longer known, its name's
    ds.attrs.update(gpu_backend="twin", gpu_name="NVIDIA H200 (twin)", twin_profile="h200-sxm")
    assert roofline(ds).attrs["gpu_profile"] == "h200-sxm"
    ds.attrs["twin_profile"] = "h200-sxm-fit"
    assert roofline(ds).attrs["gpu_profile"] == "h200-sxm"


def test_an_older_fleets_twin_cube_is_the_model_its_gpus_ran() -> None:
    """A fleet mixing twin models (`--gpus 0,h200-sxm:0`) wrote each model's cube under the
    campaign's `gpu.profile` before dvfs recorded the profile its GPUs ran: the H200 twins'
    cube says `twin_profile = "h100-sxm:none"`. Its roofline got the H100's ridge points (its
    name's, the H200's, before the twin's own profile was preferred), and `twin fit` its base;
    a twin GPU named as another shipped profile's twin is that profile's, traps kept."""
    from dvfs.twin.profiles import gpu_profile, recorded_gpu_profile

    ds = roofline_cube(8)
    ds.attrs.update(gpu_backend="twin", gpu_name="NVIDIA H200 (twin)", twin_profile="h100-sxm:none")
    assert roofline(ds).attrs["gpu_profile"] == "h200-sxm"
    assert recorded_gpu_profile(ds.attrs) == gpu_profile("h200-sxm:none")
    ds.attrs["twin_profile"] = "h200-sxm:leakage"  # its own: kept, traps and all
    assert recorded_gpu_profile(ds.attrs) == gpu_profile("h200-sxm:leakage")


# --- where a drafter saves (issue 9) -------------------------------------------------------


@pytest.mark.parametrize(
    ("states", "says"),
    [
        ([SAVES, SAVES, SAVES], "saves at every batch"),
        ([LOSES, LOSES, LOSES], "never saves"),
        ([NOT_WITHIN, NOT_WITHIN, NOT_WITHIN], "never within target"),
        ([NO_DATA, NO_DATA, NO_DATA], "no data"),
        ([SAVES, SAVES, LOSES], "saves up to batch 8"),
        ([LOSES, SAVES, SAVES], "saves from batch 8"),
        ([SAVES, LOSES, SAVES], "saves at batches 1, 64"),
        ([SAVES, SAVES, NOT_WITHIN], "saves at batches 1, 8; not within target at batch 64"),
        ([SAVES, LOSES, NOT_WITHIN], "saves up to batch 1; not within target at batch 64"),
        (
            [LOSES, NOT_WITHIN, NO_DATA],
            "never saves; not within target at batch 8; no data at batch 64",
        ),
        ([NOT_WITHIN, NOT_WITHIN, NO_DATA], "never within target; no data at batch 64"),
    ],
)
def test_break_even_summary_says_what_happened(states, says) -> None:
    # Given out of order on purpose: the summary reads the batches in increasing order.
    pairs = list(zip(BATCHES, states, strict=True))
    assert break_even_summary(pairs[::-1]) == says


def summaries(result):
    at = result.sel(drafter="eagle3", corpus="code")
    return str(at["break_even_equal_clock"].item()), str(at["break_even_equal_latency"].item())


def spec_cube(energy, latency):
    return make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        latency=lambda c, p, b, d, *_: latency(c, b, d),
        energy=lambda c, p, b, d, *_: energy(c, b, d),
    )


def baseline_latency(c, b, d):
    return 10.0 if c == 2000 else 12.0


def test_a_drafter_that_never_meets_the_latency_target_is_not_said_to_save() -> None:
    # EAGLE-3 saves energy at equal clock but is slower than none's stock TPOT at every clock.
    cube = spec_cube(
        energy=lambda c, b, d: 0.5 if d == "eagle3" else 1.0,
        latency=lambda c, b, d: 20.0 if d == "eagle3" else baseline_latency(c, b, d),
    )
    result = compare(cube)
    assert summaries(result) == ("saves at every batch", "never within target")
    # The break-even batch alone is NaN for both: only the summary tells them apart.
    at = result.sel(drafter="eagle3", corpus="code")
    assert math.isnan(float(at["break_even_batch_equal_latency"]))


def test_a_drafter_that_never_saves_says_so() -> None:
    cube = spec_cube(
        energy=lambda c, b, d: 2.0 if d == "eagle3" else 1.0,
        latency=lambda c, b, d: 5.0 if d == "eagle3" else baseline_latency(c, b, d),
    )
    assert summaries(compare(cube)) == ("never saves", "never saves")


def test_saves_from_and_up_to_a_batch() -> None:
    up_to = compare(cube())
    assert summaries(up_to) == ("saves up to batch 8", "saves up to batch 8")
    # A drafter that only pays off once batching makes the baseline compute-heavy.
    cube_from = spec_cube(
        energy=lambda c, b, d: (1.5 if b == 1 else 0.5) if d == "eagle3" else 1.0,
        latency=lambda c, b, d: 5.0 if d == "eagle3" else baseline_latency(c, b, d),
    )
    assert summaries(compare(cube_from)) == ("saves from batch 8", "saves from batch 8")
    every = spec_cube(
        energy=lambda c, b, d: 0.5 if d == "eagle3" else 1.0,
        latency=lambda c, b, d: 5.0 if d == "eagle3" else baseline_latency(c, b, d),
    )
    assert summaries(compare(every)) == ("saves at every batch", "saves at every batch")


def test_the_break_even_table_and_json_carry_the_summary() -> None:
    from dvfs.report import compare_document, compare_tables

    cube = spec_cube(
        energy=lambda c, b, d: 0.5 if d == "eagle3" else 1.0,
        latency=lambda c, b, d: 20.0 if d == "eagle3" else baseline_latency(c, b, d),
    )
    doc = compare_document(compare(cube), None, cube)
    [entry] = doc["break_even_batch"]
    assert entry["equal_latency"] is None
    assert entry["equal_latency_summary"] == "never within target"
    assert entry["equal_clock_summary"] == "saves at every batch"
    [_, (title, header, rows)] = compare_tables(doc)
    assert header == ["drafter", "corpus", "equal clock", "equal latency"]
    assert rows == [["eagle3", "code", "saves at every batch", "never within target"]]
    assert "saves at every batch measured" not in title


def test_compare_needs_a_drafter_besides_the_baseline() -> None:
    with pytest.raises(AnalysisError, match="no drafter besides the baseline 'none'"):
        compare(make_cube(clocks=CLOCKS, drafters=["none"]))


def test_a_ratio_below_one_never_prints_as_one() -> None:
    """compare's "saves up to batch N" beside a ratio of 0.997 must not read "1.00"."""
    from dvfs.report.compare import ratio_text

    assert ratio_text(0.997) == "0.997" and ratio_text(1.004) == "1.004"
    assert ratio_text(1.0) == "1.00" and ratio_text(0.5) == "0.50"
    assert ratio_text(None, missing="too slow") == "too slow"


@pytest.mark.parametrize("how", ["missing", "invalid"])
def test_without_a_baseline_reference_no_drafter_is_called_too_slow(how: str) -> None:
    """none's stock cell not measured yet (a partial sweep) or invalid (a tenant on the GPU):
    there is no latency to meet, so the tables and the finding say there is nothing to compare,
    not that the drafter is too slow; a drafter slower at every clock still is."""
    from dvfs.report import compare_document, compare_tables
    from dvfs.report.findings import speculation_finding

    def stock_of_none(c: int, d: str) -> bool:
        return d == "none" and c == max(CLOCKS)

    cube = make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        latency=lambda c, p, b, d, *_: LATENCY[(d, c)],
        energy=lambda c, p, b, d, *_: (
            math.nan if how == "missing" and stock_of_none(c, d) else ENERGY[(d, b, c)]
        ),
        valid=lambda c, p, b, d, *_: not (how == "invalid" and stock_of_none(c, d)),
    )
    doc = compare_document(compare(cube), None, cube)
    [(_, _, rows), *_] = compare_tables(doc)
    assert [row[-1] for row in rows] == ["-"] * len(BATCHES)
    headline = speculation_finding(doc, ()).headline
    assert "meets 'none''s latency" not in headline, headline
    assert "compared" in headline, headline
    slow = spec_cube(
        energy=lambda c, b, d: 0.5 if d == "eagle3" else 1.0,
        latency=lambda c, b, d: 20.0 if d == "eagle3" else baseline_latency(c, b, d),
    )
    doc = compare_document(compare(slow), None, slow)
    [(_, _, rows), *_] = compare_tables(doc)
    assert [row[-1] for row in rows] == ["too slow"] * len(BATCHES)
    assert "No drafter meets 'none''s latency" in speculation_finding(doc, ()).headline


def test_a_drafter_with_no_setting_to_judge_is_not_called_too_slow() -> None:
    """EAGLE-3 is faster than none at every clock, but one of its two repeats is invalid
    everywhere (one invalid repeat rules a setting out): no setting of it could be judged, so
    there is nothing to compare at equal latency, not a drafter too slow for it."""
    from dvfs.report import compare_document, compare_tables

    ds = make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        repeats=2,
        latency=lambda c, p, b, d, *_: LATENCY[(d, c)],
        energy=lambda c, p, b, d, *_: ENERGY[(d, b, c)],
        valid=lambda c, p, b, d, k, r: not (d == "eagle3" and r == 1),
    )
    result = compare(ds)
    assert set(result["verdict_equal_latency"].sel(drafter="eagle3").values.ravel()) == {NO_DATA}
    assert summaries(result)[1] == NO_DATA
    doc = compare_document(result, None, ds)
    [(_, _, rows), *_] = compare_tables(doc)
    assert [row[-1] for row in rows] == ["-"] * len(BATCHES)


def test_the_best_case_headline_says_what_its_ratio_was_judged() -> None:
    """EAGLE-3 at equal latency spends 0.95, 1.05 and 0.991 of none's energy in three repeats:
    a mean just below 1 whose interval holds 1. The report's headline gives the ratio as the
    table does (never "1.00x" for one below 1) and says it is within noise, not a saving."""
    from dvfs.report import compare_document
    from dvfs.report.compare import ratio_text
    from dvfs.report.findings import speculation_finding

    share = [0.95, 1.05, 0.991]
    ds = make_cube(
        clocks=[2000],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, *_: 4.0 if d == "eagle3" else 10.0,
        energy=lambda c, p, b, d, k, r: share[r] if d == "eagle3" else 1.0,
    )
    doc = compare_document(compare(ds), None, ds)
    [row] = [r for r in doc["rows"] if r["drafter"] == "eagle3"]
    assert row["verdict_equal_latency"] == "within noise"
    assert row["energy_ratio_equal_latency"] < 1
    headline = speculation_finding(doc, ()).headline
    assert f"best case is {ratio_text(row['energy_ratio_equal_latency'])}x" in headline
    assert "1.00x" not in headline and "within noise" in headline, headline


def test_the_headline_says_too_few_repeats_where_none_could_be_judged() -> None:
    """none's stock cell valid in one of three repeats at batch 8 (no setting can be judged
    against it) and EAGLE-3 slower than none at every setting at batch 1: the headline says
    batch 8's row has too few usable repeats, not that it has no valid cells to compare."""
    from dvfs.report import compare_document
    from dvfs.report.findings import speculation_finding

    ds = make_cube(
        clocks=CLOCKS,
        batches=[1, 8],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, *_: (
            ((20.0 if b == 1 else 5.0) if d == "eagle3" else 10.0) * 2000 / c
        ),
        energy=lambda c, p, b, d, *_: 0.5 if d == "eagle3" else 1.0,
        valid=lambda c, p, b, d, k, r: not (c == 2000 and b == 8 and d == "none" and r > 0),
    )
    doc = compare_document(compare(ds), None, ds)
    verdicts = {r["batch"]: r["verdict_equal_latency"] for r in doc["rows"]}
    assert verdicts == {1: NOT_WITHIN, 8: "too few repeats"}
    headline = speculation_finding(doc, ()).headline
    assert "in 1 of 2 rows" in headline and "too few usable repeats" in headline, headline
    assert "no valid cells" not in headline, headline
    only_few = ds.sel(batch=[8])
    headline = speculation_finding(compare_document(compare(only_few), None, only_few), ()).headline
    assert "too few usable repeats" in headline and "no row has valid cells" not in headline


def test_a_partial_cubes_comparison_says_its_verdicts_may_change() -> None:
    """A drafter whose low clocks are not measured yet may still meet the baseline's latency
    there: "not within target" and "too slow" rest on what is measured so far, and the
    comparison says so, as headroom does."""
    from dvfs.report import compare_document, compare_notes

    whole = cube()
    doc = compare_document(compare(whole), None, whole)
    assert not [n for n in compare_notes(doc) if n.startswith("partial cube")]
    partial = whole.copy(deep=True)
    at = {"drafter": "eagle3", "sm_clock": 1000, "batch": 64}
    partial["energy_per_token_j"].loc[at] = np.nan
    partial["tpot_ms"].loc[at] = np.nan
    partial["cell_status"].loc[at] = 0
    partial["valid"].loc[at] = np.nan
    notes = compare_notes(compare_document(compare(partial), None, partial))
    [note] = [n for n in notes if n.startswith("partial cube")]
    assert note.startswith("partial cube: 1 of 12 cells not measured yet"), note
    assert "run the same `dvfs sweep` command again" in note


def test_a_partial_cubes_comparison_counts_its_failed_cells_as_cube_info_does() -> None:
    """A partial cube with a failed cell: the report's headroom line said "2 of 12 cells not
    measured yet (1 never run, 1 failed)" but its comparison line (the report's second) only
    "2 of 12 cells not measured yet", where `dvfs cube info` counts "1 failed + 1 missing".
    Both say the cells left in the same words (one helper)."""
    from dvfs.report import compare_document, compare_notes
    from dvfs.report.headroom import partial_note

    partial = cube().copy(deep=True)
    for status, at in (
        (0, {"drafter": "eagle3", "sm_clock": 1000, "batch": 64}),
        (2, {"drafter": "eagle3", "sm_clock": 1000, "batch": 1}),
    ):
        for name in ("energy_per_token_j", "tpot_ms", "valid"):
            partial[name].loc[at] = np.nan
        partial["cell_status"].loc[at] = status
    doc = compare_document(compare(partial), None, partial)
    [note] = [n for n in compare_notes(doc) if n.startswith("partial cube")]
    said = "partial cube: 2 of 12 cells not measured yet (1 never run, 1 failed)"
    assert note.startswith(f"{said}: a ratio"), note
    headroom_line = partial_note(doc)
    assert headroom_line is not None and headroom_line.startswith(f"{said}; answers"), headroom_line


def test_a_headline_names_a_merged_cubes_gpu_by_its_uuid_once() -> None:
    """A merged cube's rows carry the GPU's UUID, which already says GPU: the headline names
    "GPU-47dfcd23", never "GPU GPU-47dfcd23"; an index or a model's name is "GPU NAME"."""
    from dvfs.report import compare_document
    from dvfs.report.common import gpu_words
    from dvfs.report.findings import speculation_finding

    ds = make_cube(
        clocks=[2000],
        drafters=["none", "eagle3"],
        latency=lambda c, p, b, d, *_: 4.0 if d == "eagle3" else 10.0,
        energy=lambda c, p, b, d, *_: 0.5 if d == "eagle3" else 1.0,
    )
    doc = compare_document(compare(ds), None, ds)
    uuid = "GPU-47dfcd23-0000-1111-2222-333344445555"
    for row in doc["rows"]:
        row["gpu"] = uuid
    headline = speculation_finding(doc, ()).headline
    assert f"({uuid[:12]}, batch" in headline and "GPU GPU-" not in headline, headline
    assert gpu_words("h200-sxm") == "GPU h200-sxm" and gpu_words("0") == "GPU 0"


def test_without_a_profile_the_compute_bound_clocks_are_no_lower_bounds() -> None:
    """With a measured roofline of a GPU the twin has no profile of, the verify passes are set
    against the measured ridge itself, neither lowered for a pass of few tokens nor raised for
    a speculative verify pass's KV-cache reads at the tree attention's bandwidth (f38d8d9).
    The note still told the user to read the compute-bound clocks as lower bounds, true of the
    first alone: a batch-64 EAGLE-3 pass at a 1,024-token context, compute-bound at or below
    1605 MHz against an H100's own measured ridge and profile, read as compute-bound at every
    clock up to 1980 MHz against the same ridge under another GPU's name. The note says the
    clocks are estimates, off either way."""
    import xarray as xr

    clocks = tuple(range(705, 1981, 75))
    ds = roofline_cube(8, clocks)
    ds.attrs.update(
        gpu_backend="nvml",
        campaign=json.dumps({"workload": {"input_tokens": [1024, 1024], "output_tokens": 64}}),
    )
    ridge = roofline(ds)["ridge_point"].values

    def measured(name: str) -> xr.Dataset:
        return xr.Dataset(
            {
                "sm_clock_mhz": ("setting", [float(c) for c in clocks]),
                "ridge_point": ("setting", ridge),
            },
            attrs={"gpu_name": name},
        )

    def top(roof: xr.Dataset) -> int:
        bound = roof["compute_bound"].sel(batch=64, drafter="eagle3")
        return int(roof["sm_clock"].values[bound.values].max())

    profiled = roofline(ds, measured=measured("NVIDIA H100 80GB HBM3"))
    ds.attrs["gpu_name"] = "NVIDIA L40S"
    notes: list[str] = []
    unprofiled = roofline(ds, measured=measured("NVIDIA L40S"), notes=notes)
    assert (top(profiled), top(unprofiled)) == (1605, 1980)  # the clock given is above
    [note] = notes
    assert "lower bounds" not in note and "estimates" in note, note
    assert "KV-cache reads" in note, note
