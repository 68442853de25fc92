"""The twin's acceptance comes from the text served, not from the corpus's name (issue 13)."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SMALL_CAMPAIGN, replace_block, write
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign import DrafterSpec
from dvfs.cli import cli
from dvfs.corpora import BUILTIN_CORPORA, load_corpus
from dvfs.twin import textprior
from dvfs.twin.drafting import plan_drafter
from dvfs.twin.profiles import accept_probability, acceptance_priors, model_profile

LLAMA8B = model_profile("llama-3.1-8b")
DRAFTERS = {
    "eagle3": DrafterSpec("eagle3", "EAGLE3", "eagle3-llama-3.1-8b", 5, 4, 8),
    "eagle": DrafterSpec("eagle", "EAGLE", None, 5, 4, 8),
    "standalone": DrafterSpec("standalone", "STANDALONE", "llama-3.2-1b", 4, 1, 5),
    "dflash": DrafterSpec("dflash", "DFLASH", None, None, None, 16),
    "ngram": DrafterSpec("ngram", "NGRAM", None, None, None, 12),
}
TRAINED = [d for d in DRAFTERS if d != "ngram"]
EXPECTED = {
    "code": ("code", "english"),
    "conversation": ("conversation", "english"),
    "english": ("prose", "english"),
    "math": ("math", "english"),
    "romansh": ("prose", "romansh"),
}


def builtin_text(name: str) -> str:
    return resources.files("dvfs.corpora").joinpath("data", f"{name}.jsonl").read_text("utf-8")


@pytest.mark.parametrize("name", BUILTIN_CORPORA)
def test_each_builtin_corpus_reads_as_its_own_class(name: str) -> None:
    text = textprior.builtin_profile(name)
    assert (text.genre, text.language) == EXPECTED[name]
    assert text.acceptance_class == name


def test_the_ngram_calibration_is_the_least_squares_fit_it_claims() -> None:
    """acceptance.toml's two numbers re-derived from the built-in texts and published taus."""
    prior = acceptance_priors()["ngram"]
    names = prior.calibrated_on
    assert set(names) <= set(BUILTIN_CORPORA) and len(names) >= 2
    r = np.array([textprior.builtin_profile(n).ngram_repetition for n in names])
    alpha = np.array([accept_probability(prior.tau(n), prior.ref_depth) for n in names])
    (intercept, slope), *_ = np.linalg.lstsq(np.c_[np.ones(len(r)), np.sqrt(r)], alpha)
    assert prior.alpha_intercept == pytest.approx(intercept, abs=1e-3)
    assert prior.alpha_per_sqrt_repetition == pytest.approx(slope, abs=1e-3)
    plan = plan_drafter(DrafterSpec("n", "NGRAM", None, None, None, prior.ref_depth + 1), LLAMA8B)
    assert plan is not None
    for name in names:  # the calibrated corpora land near their published accept length
        got = plan.expected_accept_length(textprior.builtin_profile(name), 0.0)
        assert got == pytest.approx(prior.tau(name), abs=0.05)


def test_the_ngram_calibration_reproduces_its_corpora_as_the_readme_says() -> None:
    """README ("The digital twin"): the calibrated corpora's published taus reproduced within
    a stated distance, at SGLang's default 12 draft tokens, the twin's values beside them. It
    said within 0.01, but math comes to 1.718 against 1.73."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = re.search(
        r"their published ([0-9./ ]+?) reproduced within ([0-9.]*[0-9])"
        r"(?: \(the twin: ([0-9./ ]+)\))?",
        " ".join(readme.split()),
    )
    assert said, "the README's n-gram calibration sentence is gone"
    published = [float(v) for v in said.group(1).split("/")]
    within = float(said.group(2))
    stated = [float(v) for v in (said.group(3) or "").split("/") if v.strip()]
    prior = acceptance_priors()["ngram"]
    assert published == [prior.tau(n) for n in prior.calibrated_on]
    plan = plan_drafter(DRAFTERS["ngram"], LLAMA8B)
    assert plan is not None
    names = prior.calibrated_on
    for name, want in zip(names, published, strict=True):
        got = plan.expected_accept_length(textprior.builtin_profile(name), 0.0)
        assert abs(got - want) <= within, (name, got, want)
    assert len(stated) == len(published), "the README gives the twin's values beside them"
    twin = [plan.expected_accept_length(textprior.builtin_profile(n), 0.0) for n in names]
    assert twin == pytest.approx(stated, abs=0.005)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_accepts_less_on_conversation_than_on_code(drafter: str) -> None:
    plan = plan_drafter(DRAFTERS[drafter], LLAMA8B)
    assert plan is not None
    code, conversation = (textprior.builtin_profile(n) for n in ("code", "conversation"))
    assert plan.alpha(conversation, 0.0) < plan.alpha(code, 0.0)


@pytest.mark.parametrize("drafter", TRAINED)
def test_every_trained_drafter_accepts_less_on_romansh_than_on_english(drafter: str) -> None:
    plan = plan_drafter(DRAFTERS[drafter], LLAMA8B)
    assert plan is not None
    english, romansh = (textprior.builtin_profile(n) for n in ("english", "romansh"))
    assert plan.alpha(romansh, 0.0) < 0.9 * plan.alpha(english, 0.0)


def test_ngram_acceptance_rises_with_the_prompts_repetition() -> None:
    plan = plan_drafter(DRAFTERS["ngram"], LLAMA8B)
    assert plan is not None
    prompts = [[p.messages[-1].content] for p in load_corpus("conversation").prompts]
    alphas = []
    for copies in (1, 2, 4):  # each prompt quotes itself more often
        text = textprior.profile(["\n\n".join(m * copies) for m in prompts])
        assert text.genre == "conversation"
        alphas.append(plan.alpha(text, 0.0))
    assert alphas[0] < alphas[1] < alphas[2]


def test_the_language_comes_from_the_words_and_the_script() -> None:
    english = ["Could you tell me what the weather is like in the mountains this week?"]
    romansh = ["Co vai cun il temp en las muntognas questa emna? Jau na sai betg quai."]
    russian = ["Какая погода будет в горах на этой неделе? Я не знаю, что взять с собой."]
    assert textprior.profile([english]).language == "english"
    assert textprior.profile([romansh]).language == "romansh"
    other = textprior.profile([russian])
    assert (other.language, other.features.script) == ("other", "cyrillic")
    assert other.acceptance_class == "romansh"  # the non-English row


def test_each_trained_drafters_romansh_row_is_its_english_row_times_the_language_ratio() -> None:
    """acceptance.toml: no Romansh measurement exists; A4's English/Chinese ratio (6.4 against
    3.3, 0.52) is applied to each trained drafter's english (prose) value, and DFLASH's other
    classes are its GSM8K 6.40 scaled by EAGLE-3's ratios to math. DFLASH's romansh was A4's
    Chinese GSM8K figure (3.30) itself: non-English math, 16% above what either rule gives
    for the prose the romansh row stands for (2.85)."""
    priors = acceptance_priors()
    for family in ("eagle3", "standalone", "dflash"):
        prior = priors[family]
        assert prior.tau("romansh") == pytest.approx(prior.tau("english") * 0.52, abs=0.01)
    eagle3, dflash = priors["eagle3"], priors["dflash"]
    for name in textprior.CLASSES:
        scaled = dflash.tau("math") * eagle3.tau(name) / eagle3.tau("math")
        assert dflash.tau(name) == pytest.approx(scaled, abs=0.01), name


def test_code_is_code_in_any_language() -> None:
    code = "def suma(a, b):\n    # returna la summa\n    return a + b\n\nprint(suma(1, 2))\n"
    text = textprior.profile([[f"Scriva in test per quai:\n\n{code}"]])
    assert (text.genre, text.acceptance_class) == ("code", "code")


def test_an_override_sets_the_class_and_keeps_the_measurement() -> None:
    text = textprior.builtin_profile("english")
    forced = text.overridden("romansh")
    assert forced.acceptance_class == "romansh" and forced.override == "romansh"
    assert forced.ngram_repetition == text.ngram_repetition
    with pytest.raises(ValueError, match="klingon"):
        text.overridden("klingon")


words = st.lists(
    st.sampled_from(["the", "cat", "sat", "on", "mat", "(", ")", "=", "x", "1", "il", "da"]),
    min_size=0,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(toks=words)
def test_repetition_is_a_share_that_quoting_raises(toks: list[str]) -> None:
    hits, tries = textprior.repetition_counts(toks)
    assert 0 <= hits <= tries
    doubled_hits, doubled_tries = textprior.repetition_counts(toks + toks)
    if tries:
        assert doubled_hits / doubled_tries >= hits / tries


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.text(min_size=0, max_size=80), min_size=1, max_size=3),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 1000),
)
def test_a_profile_is_shares_and_ignores_the_prompts_order(
    prompts: list[list[str]], seed: int
) -> None:
    text = textprior.profile(prompts)
    f = text.features
    for share in (f.english_words, f.romansh_words, f.latin_letters, f.indented_lines):
        assert 0.0 <= share <= 1.0
    for share in (f.code_symbols, f.digits, f.personal_words, f.multi_turn, f.ngram_repetition):
        assert 0.0 <= share <= 1.0
    assert text.acceptance_class in textprior.CLASSES
    order = np.random.default_rng(seed).permutation(len(prompts))
    assert textprior.profile([prompts[i] for i in order]) == text


@settings(max_examples=200, deadline=None)
@given(r=st.floats(0.0, 1.0), dr=st.floats(0.0, 1.0))
def test_ngram_alpha_is_a_probability_that_never_falls_with_repetition(r: float, dr: float) -> None:
    prior = acceptance_priors()["ngram"]
    assert prior.alpha_intercept is not None and prior.alpha_per_sqrt_repetition is not None
    low = textprior.ngram_alpha(r, prior.alpha_intercept, prior.alpha_per_sqrt_repetition)
    high = textprior.ngram_alpha(
        min(1.0, r + dr), prior.alpha_intercept, prior.alpha_per_sqrt_repetition
    )
    assert 0.0 <= low <= high < 1.0 and not math.isnan(high)


# -- through the CLI --------------------------------------------------------------------------
SWAPPED = (
    replace_block(
        replace_block(
            replace_block(SMALL_CAMPAIGN, "sm_clock = [1980, 1500, 1005]", "sm_clock = [1980]"),
            "power_limit = [700, 300]",
            "power_limit = [700]",
        ),
        'corpora = ["code", "conversation"]',
        'corpora = ["english", "romansh", "rumantsch"]',
    )
    + "\n[corpus.romansh]                 # named Romansh, holds English\n"
    'path = "data/english.jsonl"\nmessages = "messages"\n'
    "\n[corpus.rumantsch]               # Romansh text under another name\n"
    'path = "data/romansh.jsonl"\nmessages = "messages"\n'
)


def test_a_corpus_named_romansh_holding_english_accepts_like_english(tmp_path: Path) -> None:
    import dvfs

    write(tmp_path / "data" / "english.jsonl", builtin_text("english"))
    write(tmp_path / "data" / "romansh.jsonl", builtin_text("romansh"))
    campaign = write(tmp_path / "swapped.toml", SWAPPED)
    dry = CliRunner().invoke(cli, ["sweep", str(campaign), "--dry-run", "--json", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    eagle3 = json.loads(dry.output)["servers"][1]["expected_accept_length"]
    assert eagle3["romansh"] == eagle3["english"] > 1.2 * eagle3["rumantsch"]

    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    ds = dvfs.open_cube(str(out / "cube.nc"))
    texts = {name: c["text"] for name, c in json.loads(ds.attrs["corpora"]).items()}
    assert texts["romansh"]["acceptance_class"] == texts["english"]["acceptance_class"] == "english"
    assert texts["romansh"]["language"] == "english"
    assert (texts["rumantsch"]["language"], texts["rumantsch"]["acceptance_class"]) == (
        "romansh",
        "romansh",
    )
    accept = ds["accept_length"].sel(drafter="eagle3").mean(["sm_clock", "power_limit", "repeat"])
    english, named_romansh, rumantsch = (
        accept.sel(corpus=c).values for c in ("english", "romansh", "rumantsch")
    )
    # Same class, different prompts drawn: equal within the draw's noise; Romansh far below.
    assert np.all(np.abs(named_romansh - english) < 0.25 * (english - rumantsch))
    assert np.all(rumantsch < 0.8 * english)


def test_acceptance_like_overrides_what_the_text_says(tmp_path: Path) -> None:
    write(tmp_path / "data" / "english.jsonl", builtin_text("english"))
    text = replace_block(
        SWAPPED,
        'path = "data/english.jsonl"',
        'path = "data/english.jsonl"\nacceptance_like = "romansh"',
    )
    write(tmp_path / "data" / "romansh.jsonl", builtin_text("romansh"))
    campaign = write(tmp_path / "override.toml", text)
    dry = CliRunner().invoke(cli, ["sweep", str(campaign), "--dry-run", "--json", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    eagle3 = json.loads(dry.output)["servers"][1]["expected_accept_length"]
    assert eagle3["romansh"] == eagle3["rumantsch"] < eagle3["english"]


def test_corpus_list_says_how_each_builtin_reads() -> None:
    listed = CliRunner().invoke(cli, ["corpus", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    for row in json.loads(listed.output)["corpora"]:
        text = row["text"]
        assert (text["genre"], text["language"]) == EXPECTED[row["name"]]
        assert text["acceptance_class"] == row["name"]


def test_a_corpus_is_read_once_per_content() -> None:
    corpus = load_corpus("math")
    assert textprior.profile_corpus(corpus) is textprior.profile_corpus(corpus)


@pytest.mark.parametrize(
    ("algorithm", "draft_model", "expected"),
    [("EAGLE3", "eagle3-llama-3.1-8b", (5, 4, 8)), ("STANDALONE", "llama-3.2-1b", (3, 1, 4))],
)
def test_unset_speculative_numbers_resolve_as_sglang_chooses_them(
    algorithm: str, draft_model: str, expected: tuple[int, int, int]
) -> None:
    """Left unset, SGLang picks (5, 4, 8) for a Llama target's EAGLE drafters but always
    (3, 1, 4) for a standalone draft model (its `_auto_choose_speculative_params`)."""
    plan = plan_drafter(DrafterSpec("d", algorithm, draft_model, None, None, None), LLAMA8B)
    assert plan is not None
    assert (plan.num_steps, plan.topk, plan.verify_tokens) == expected
