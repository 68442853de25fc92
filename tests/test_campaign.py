"""Campaign validation: one clear error naming the key, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL_CAMPAIGN, replace_block, write

from dvfs.campaign import load_campaign
from dvfs.errors import CampaignError

REPO = Path(__file__).resolve().parent.parent


def load_text(tmp_path: Path, text: str):
    return load_campaign(write(tmp_path / "c.toml", text))


def expect_error(tmp_path: Path, text: str, *fragments: str) -> str:
    with pytest.raises(CampaignError) as info:
        load_text(tmp_path, text)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_demo_and_small_campaigns_load(tmp_path: Path) -> None:
    demo = load_campaign(REPO / "sweeps" / "demo.toml")
    assert [d.name for d in demo.drafters] == ["none", "eagle3", "standalone", "ngram", "dflash"]
    assert demo.workload.batch_sizes == (1, 4, 16, 32, 64)
    assert demo.workload.corpus_names == ("code", "conversation", "english", "math", "romansh")
    assert all(c % 15 == 0 for c in demo.knobs.sm_clocks_mhz)
    assert len(demo.knobs.power_limits_w) >= 2
    assert demo.drafter("dflash").num_draft_tokens == 16
    small = load_text(tmp_path, SMALL_CAMPAIGN)
    assert small.knobs.sm_clocks_mhz == (1980, 1500, 1005)
    assert small.knobs.power_limits_w == (700.0, 300.0)


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "settle_s = 1.0", "setle_s = 1.0")
    expect_error(tmp_path, text, "knobs.setle_s", "did you mean 'settle_s'", "allowed in [knobs]")


def test_unknown_section(tmp_path: Path) -> None:
    expect_error(
        tmp_path, SMALL_CAMPAIGN + "\n[knob]\nx = 1\n", "unknown key 'knob'", "did you mean 'knobs'"
    )


def test_bad_value_type(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "batch = [1, 8]", 'batch = ["four"]')
    expect_error(tmp_path, text, "workload.batch", "positive integers", '"four"')


def test_unknown_algorithm_names_the_choices(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, 'algorithm = "EAGLE3"', 'algorithm = "MEDUSA"')
    expect_error(
        tmp_path, text, "drafters.eagle3.algorithm", "'MEDUSA'", "EAGLE3", "NGRAM", "DFLASH"
    )


def test_unknown_draft_model_for_the_twin(tmp_path: Path) -> None:
    text = SMALL_CAMPAIGN + (
        '\n[drafters.small]\nalgorithm = "STANDALONE"\ndraft_model = "acme/tiny-drafter"\n'
        "num_steps = 3\neagle_topk = 1\nnum_draft_tokens = 4\n"
    )
    expect_error(tmp_path, text, "drafters.small.draft_model", "acme/tiny-drafter", "llama-3.2-1b")


def test_unknown_corpus(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, '"conversation"]', '"conversaton"]')
    expect_error(tmp_path, text, "workload.corpora", "'conversaton'", "did you mean 'conversation'")


def test_clock_not_a_multiple_of_the_step(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "sm_clock = [1980, 1500, 1005]", "sm_clock = [1980, 1507]")
    expect_error(tmp_path, text, "knobs.sm_clock", "1507 MHz", "15 MHz steps", "1500, 1515")


def test_clock_range_must_reach_stop(tmp_path: Path) -> None:
    text = replace_block(
        SMALL_CAMPAIGN,
        "sm_clock = [1980, 1500, 1005]",
        "sm_clock = { start = 900, stop = 1980, step = 100 }",
    )
    expect_error(tmp_path, text, "knobs.sm_clock", "stop 1980 is not reached")


def test_clock_range_expands(tmp_path: Path) -> None:
    text = replace_block(
        SMALL_CAMPAIGN,
        "sm_clock = [1980, 1500, 1005]",
        "sm_clock = { start = 1800, stop = 1980, step = 90 }",
    )
    assert load_text(tmp_path, text).knobs.sm_clocks_mhz == (1800, 1890, 1980)


def test_power_limit_out_of_range(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "power_limit = [700, 300]", "power_limit = [800]")
    expect_error(tmp_path, text, "knobs.power_limit", "800 W", "200-700 W")


def test_partial_eagle_triple_is_refused(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "num_draft_tokens = 4\n", "")
    expect_error(tmp_path, text, "drafters.eagle3.num_draft_tokens", "all set or none")


def test_topk_one_forces_draft_tokens(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "num_draft_tokens = 4", "num_draft_tokens = 6")
    expect_error(tmp_path, text, "num_steps + 1 = 4", "not 6")


def test_observe_only_requires_stock_knobs(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, "devices = [0]", 'devices = [0]\nactuation = "off"')
    expect_error(tmp_path, text, "observe-only", "stock")


def test_tp_size_must_match_devices(tmp_path: Path) -> None:
    text = replace_block(
        SMALL_CAMPAIGN, 'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2'
    )
    expect_error(tmp_path, text, "engine.tp_size", "1 GPU(s)")


def test_fixed_mode_needs_ignore_eos(tmp_path: Path) -> None:
    text = replace_block(
        SMALL_CAMPAIGN, "output_tokens = 64", "output_tokens = 64\nignore_eos = false"
    )
    expect_error(tmp_path, text, "workload.ignore_eos", "fixed-batch")


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    expect_error(tmp_path, "[gpu\n", "not valid TOML")
    with pytest.raises(CampaignError, match="does not exist"):
        load_campaign(tmp_path / "nope.toml")


def test_hash_ignores_description_but_not_the_grid(tmp_path: Path) -> None:
    base = load_text(tmp_path, SMALL_CAMPAIGN)
    described = load_text(
        tmp_path,
        replace_block(SMALL_CAMPAIGN, 'name = "small"', 'name = "small"\ndescription = "hello"'),
    )
    regridded = load_text(
        tmp_path, replace_block(SMALL_CAMPAIGN, "batch = [1, 8]", "batch = [1, 16]")
    )
    assert base.hash == described.hash
    assert base.hash != regridded.hash
