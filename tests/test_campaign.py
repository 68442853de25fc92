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


def test_misspelt_key_of_a_corpus_table_gets_a_suggestion(tmp_path: Path) -> None:
    # A `[corpus.NAME]` table's misspelt key is named with a "did you mean", as every other
    # table's is (README "Campaign files"); it listed only the allowed keys.
    text = replace_block(SMALL_CAMPAIGN, '"conversation"]', '"mine"]')
    text += '\n[corpus.mine]\npaht = "x.jsonl"\nfeild = "text"\n'
    expect_error(
        tmp_path,
        text,
        "[corpus.mine]",
        "feild (did you mean 'field'?)",
        "paht (did you mean 'path'?)",
        "allowed:",
    )


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


@pytest.mark.parametrize("algorithm", ["DSPARK", "UNO"])
def test_partial_triple_is_refused_at_load_for_every_algorithm_that_passes_it(
    tmp_path: Path, algorithm: str
) -> None:
    """DSPARK and UNO get the three numbers on their command line as the EAGLE family does
    (all or none): a partial set is refused when the campaign loads, not at the arm's first
    server start, hours into a sweep."""
    text = replace_block(SMALL_CAMPAIGN, 'backend = "twin"\nmodel', 'backend = "sglang"\nmodel')
    text += f"""
[drafters.other]
algorithm = "{algorithm}"
draft_model = "some/drafter"
num_steps = 3
"""
    expect_error(tmp_path, text, "drafters.other.eagle_topk", "all set or none")


@pytest.mark.parametrize("key", ["num_steps", "eagle_topk"])
def test_ngram_numbers_it_would_ignore_are_refused(tmp_path: Path, key: str) -> None:
    """NGRAM's launch argv carries num_draft_tokens alone (SGLang sets the topk from its BFS
    breadth): a num_steps or eagle_topk there would be recorded with the drafter yet reach
    neither the server nor the twin, so it is refused, naming the flag that sets the breadth."""
    text = (
        SMALL_CAMPAIGN
        + f"""
[drafters.ngram]
algorithm = "NGRAM"
num_draft_tokens = 12
{key} = 4
"""
    )
    expect_error(tmp_path, text, f"drafters.ngram.{key}", "--speculative-ngram-max-bfs-breadth")


def test_a_journal_that_recorded_ngram_numbers_resumes_once_they_are_removed(
    tmp_path: Path,
) -> None:
    """An earlier dvfs took num_steps/eagle_topk on an NGRAM drafter and recorded them (and
    hashed them) though they reached nothing. Removed as the refusal asks, the campaign resumes
    that journal: those two are no measured difference; a number NGRAM does use still is."""
    from dataclasses import replace

    from dvfs.records.header import Header

    text = SMALL_CAMPAIGN + '\n[drafters.ngram]\nalgorithm = "NGRAM"\nnum_draft_tokens = 12\n'
    campaign = load_text(tmp_path, text)
    stored = campaign.semantic_dict()
    (ngram,) = (d for d in stored["drafters"] if d["name"] == "ngram")
    ngram.update(num_steps=3, eagle_topk=2)  # as the earlier dvfs stored them
    old = replace(Header.for_campaign(campaign), campaign_hash="0" * 16, campaign=stored)
    assert old.differences(campaign) == []
    ngram["num_draft_tokens"] = 8
    (difference,) = old.differences(campaign)
    assert difference.startswith("drafters[ngram].num_draft_tokens:"), difference


@pytest.mark.parametrize("key", ["num_steps", "eagle_topk"])
def test_a_dflash_number_other_than_one_is_named_by_its_own_key(tmp_path: Path, key: str) -> None:
    text = SMALL_CAMPAIGN + (
        '\n[drafters.block]\nalgorithm = "DFLASH"\n'
        'draft_model = "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"\n'
        f"num_draft_tokens = 16\n{key} = 2\n"
    )
    expect_error(tmp_path, text, f"drafters.block.{key}", "fixed at 1")


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
    with pytest.raises(CampaignError, match="does not exist") as missing:
        load_campaign(tmp_path / "nope.toml")
    assert "ships" not in str(missing.value)  # no campaign of that name is shipped


@pytest.mark.parametrize("under", ["x.toml", "deeper/x.toml"])
def test_a_campaign_path_under_a_regular_file_names_that_file(tmp_path: Path, under: str) -> None:
    """`dvfs sweep afile/x.toml`: "cannot read campaign file afile/x.toml: Not a directory",
    which said neither which part of the path is a file nor what to do. It says the file does
    not exist, names the file in the way, and says to check the path."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    (tmp_path / "afile").write_text("x")
    path = tmp_path / "afile" / under
    for command in ("sweep", "doctor"):
        result = CliRunner().invoke(cli, [command, str(path)])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.splitlines()
        assert line == (
            f"Error: campaign file {path} does not exist: {tmp_path / 'afile'} is a file, not "
            "a folder; check the path"
        ), line


def test_a_missing_campaign_named_as_a_shipped_one_says_where_that_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's `sweeps/demo.toml` is there only in a clone: run elsewhere (an installed
    dvfs), the error points at the demo campaign dvfs ships, which then loads."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["sweep", "sweeps/demo.toml", "--dry-run", "--no-estimate"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "campaign file sweeps/demo.toml does not exist" in said and "dvfs demo" in said
    shipped = said.split("ships a 'demo' campaign at ", 1)[1].split(" (", 1)[0]
    assert load_campaign(shipped).name == "demo"


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


@pytest.mark.parametrize(
    "name",
    ["../../etc", "/abs", "a/b", "..", ".hidden", "nul\\u0000byte", "trailing\\n", "back\\\\slash"],
)
def test_a_campaign_name_cannot_escape_the_output_folder(tmp_path: Path, name: str) -> None:
    text = replace_block(SMALL_CAMPAIGN, 'name = "small"', f'name = "{name}"')
    expect_error(tmp_path, text, "campaign.name", "becomes a folder")


def test_a_file_name_that_cannot_name_the_campaign(tmp_path: Path) -> None:
    text = replace_block(SMALL_CAMPAIGN, 'name = "small"\n', "")
    assert load_campaign(write(tmp_path / "ok-name.toml", text)).name == "ok-name"
    with pytest.raises(CampaignError, match=r"set \[campaign\] name"):
        load_campaign(write(tmp_path / "my sweep.toml", text))


def test_drafter_and_corpus_names_with_a_trailing_newline_are_refused(tmp_path: Path) -> None:
    drafter = replace_block(SMALL_CAMPAIGN, "[drafters.none]", '[drafters."none\\n"]')
    expect_error(tmp_path, drafter, "drafter name")
    corpus = SMALL_CAMPAIGN + '\n[corpus."mine\\n"]\npath = "x.jsonl"\n'
    expect_error(tmp_path, corpus, "corpus name")


@pytest.mark.parametrize("name", ["..", "-mine", "_mine", ".mine"])
def test_a_corpus_name_of_allowed_characters_says_it_must_start_with_one(
    tmp_path: Path, name: str
) -> None:
    """A corpus name of letters, digits, '_', '-', '.' alone but not starting with a letter or
    digit ('..', '-mine') was refused as if it used other characters ("must use letters,
    digits, '_', '-', '.'", which it does): the line says what the name lacks, as a drafter
    name's does."""
    corpus = SMALL_CAMPAIGN + f'\n[corpus."{name}"]\npath = "x.jsonl"\nfield = "text"\n'
    expect_error(tmp_path, corpus, f"corpus name {name!r} must start with a letter or digit")


@pytest.mark.parametrize(
    ("old", "new", "fragments"),
    [
        ("[workload]", "[workloads]", ("[workload]", "did you mean 'workload'")),
        ("[engine]", "[engin]", ("[engine]", "did you mean 'engine'")),
        ("batch = [1, 8]", "batches = [1, 8]", ("workload.batch", "did you mean 'batch'")),
        ('model = "llama', 'modle = "llama', ("engine.model", "did you mean 'model'")),
        ("[campaign]", "[campain]", ("'campain'", "did you mean 'campaign'")),
        # The misspelling left a default in place that then fails: name the misspelling.
        ('backend = "twin"\nprofile = "h100-sxm"', 'backnd = "twin"', ("gpu.backnd", "'backend'")),
        ("[engine]\nbackend", "[engine]\nbacknd", ("engine.backnd", "did you mean 'backend'")),
    ],
)
def test_misspelt_keys_get_a_did_you_mean(
    tmp_path: Path, old: str, new: str, fragments: tuple[str, ...]
) -> None:
    expect_error(tmp_path, replace_block(SMALL_CAMPAIGN, old, new), *fragments)


OPERATIONAL_EDITS = [
    ("idle_s = 1.0", "idle_s = 1.0\nretries = 9"),
    ('model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\n[engine.sglang]\nrequest_timeout_s = 1e4'),
    ('model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\n[engine.sglang]\nenv = { A = "1" }'),
    ('model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\n[engine.sglang]\nurl = "http://h:1"'),
    ('model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\n[engine.sglang]\nstartup_timeout_s = 5'),
    (
        'model = "llama-3.1-8b"',
        'model = "llama-3.1-8b"\n[engine.sglang]\nserver_command = ["python3", "-m", "x"]',
    ),
    ('name = "small"', 'name = "renamed"'),
]


@pytest.mark.parametrize(("old", "new"), OPERATIONAL_EDITS)
def test_operational_settings_stay_out_of_the_hash(tmp_path: Path, old: str, new: str) -> None:
    base = load_text(tmp_path, SMALL_CAMPAIGN)
    changed = load_text(tmp_path, replace_block(SMALL_CAMPAIGN, old, new))
    assert changed.hash == base.hash
    assert changed.operational_dict() != base.operational_dict() or old.startswith("name")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("output_tokens = 64", "output_tokens = 32"),
        ("settle_s = 1.0", "settle_s = 3.0"),
        ("idle_s = 1.0", "idle_s = 2.0"),
        ('model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\n[engine.sglang]\nextra_args = ["--x"]'),
        ("devices = [0]", "devices = [1]"),
        ('profile = "h100-sxm"', 'profile = "h200-sxm"'),
    ],
)
def test_measured_settings_change_the_hash(tmp_path: Path, old: str, new: str) -> None:
    base = load_text(tmp_path, SMALL_CAMPAIGN)
    assert load_text(tmp_path, replace_block(SMALL_CAMPAIGN, old, new)).hash != base.hash


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_numbers_must_be_finite(tmp_path: Path, value: str) -> None:
    text = replace_block(SMALL_CAMPAIGN, "settle_s = 1.0", f"settle_s = {value}")
    expect_error(tmp_path, text, "knobs.settle_s", "finite")


def test_a_campaign_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes("# caf\u00e9\n".encode("latin-1") + SMALL_CAMPAIGN.encode())
    with pytest.raises(CampaignError, match=r"c\.toml is not UTF-8 text \(byte 0xe9 on line 1\)"):
        load_campaign(path)


def test_a_valid_sibling_key_is_not_taken_for_a_misspelling(tmp_path: Path) -> None:
    text = replace_block(
        SMALL_CAMPAIGN,
        'model = "llama-3.1-8b"',
        'model = "llama-3.1-8b"\n[engine.sglang]\nrequest_timeout_s = -1\nstall_timeout_s = 5',
    )
    message = expect_error(tmp_path, text, "engine.sglang.request_timeout_s", "greater than 0")
    assert "did you mean" not in message


CREDENTIALS = """
[engine.sglang]
url = "http://alice:pw-1@gpu-host:30000/?token=tk-2&x=1"
server_command = ["docker", "run", "-e", "HF_TOKEN=hf-3", "--env=HF_HOME=/hf", "img",
  "python", "-m", "sglang.launch_server"]
extra_args = ["--api-key", "key-4", "--admin-api-key=key-5", "--mem-fraction-static", "0.8",
  "--ssl-keyfile", "k.pem", "--bucket-time-to-first-token", "0.5"]
"""


def test_credentials_in_url_command_and_extra_args_are_not_recorded(tmp_path: Path) -> None:
    """What a journal keeps of the campaign (the hash, the measured settings, the session's
    settings, the file's text) holds none of the URL's user and password, a secret query
    parameter, a wrapper's HF_TOKEN or an --api-key; everything else as written. The text still
    reads as the campaign, with the same hash, which a new key does not change either."""
    import json

    text = replace_block(
        SMALL_CAMPAIGN, 'model = "llama-3.1-8b"', f'model = "llama-3.1-8b"\n{CREDENTIALS}'
    )
    campaign = load_text(tmp_path, text)
    assert campaign.engine.sglang.extra_args[1] == "key-4"  # the server gets them
    secrets = ("alice", "pw-1", "tk-2", "hf-3", "key-4", "key-5")
    kept = campaign.recorded_source()
    for record in (
        kept,
        json.dumps(campaign.semantic_dict()),
        json.dumps(campaign.operational_dict()),
    ):
        assert not [s for s in secrets if s in record], record
    settings = campaign.operational_dict()
    assert settings["engine.sglang.url"] == (
        "http://(not recorded)@gpu-host:30000/?token=(not recorded)&x=1"
    )
    assert settings["engine.sglang.server_command"][3:5] == [
        "HF_TOKEN=(not recorded)",
        "--env=HF_HOME=/hf",
    ]
    assert campaign.semantic_dict()["engine"]["sglang"]["extra_args"] == [
        "--api-key",
        "(not recorded)",
        "--admin-api-key=(not recorded)",
        *("--mem-fraction-static", "0.8", "--ssl-keyfile", "k.pem"),
        *("--bucket-time-to-first-token", "0.5"),
    ]
    again = load_text(tmp_path, kept)
    assert again.hash == campaign.hash and again.operational_dict() == settings
    assert again.recorded_source() == kept
    rotated = load_text(tmp_path, text.replace("key-4", "key-6"))
    assert rotated.hash == campaign.hash
    assert load_text(tmp_path, text.replace('"0.8"', '"0.7"')).hash != campaign.hash


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (  # numbers and paths whose flags mention a token or a key stay
            ["--max-total-tokens", "100", "--speculative-token-map", "m.pt", "--ssl-keyfile", "k"],
            None,
        ),
        (["--tokenizer-path", "t", "HF_HOME=/hf", "--api-key"], None),  # no value to hide
        (["--api-key", "--dtype", "float16"], None),
        (  # abbreviations SGLang's argparse reads as its secret flags; --ssl-keyfile is a path
            ["--ap", "a", "--admin=b", "--ssl-keyfile-pass", "c", "--ssl-keyfile", "k.pem"],
            [
                "--ap",
                "(not recorded)",
                "--admin=(not recorded)",
                "--ssl-keyfile-pass",
                "(not recorded)",
                "--ssl-keyfile",
                "k.pem",
            ],
        ),  # fmt: skip
        (
            ["--hf-token", "t", "--ssl-keyfile-password", "p", "--env=AWS_SECRET_ACCESS_KEY=s"],
            [
                "--hf-token",
                "(not recorded)",
                "--ssl-keyfile-password",
                "(not recorded)",
                "--env=AWS_SECRET_ACCESS_KEY=(not recorded)",
            ],
        ),  # fmt: skip
        (
            ["env", "HF_TOKEN=a,b", "--env=HF_TOKEN=c,d", "--api-key=e,f"],
            [
                "env",
                "HF_TOKEN=(not recorded)",
                "--env=HF_TOKEN=(not recorded)",
                "--api-key=(not recorded)",
            ],
        ),  # fmt: skip
        (
            ["bash", "-c", "HF_TOKEN=t python -m sglang.launch_server --api-key k --tp 2"],
            [
                "bash",
                "-c",
                "HF_TOKEN=(not recorded) python -m sglang.launch_server "
                "--api-key (not recorded) --tp 2",
            ],
        ),  # fmt: skip
    ],
)
def test_only_credentials_are_hidden_from_a_command(
    argv: list[str], shown: list[str] | None
) -> None:
    from dvfs.redact import redact_argv

    shown = argv if shown is None else shown
    assert redact_argv(argv) == shown
    assert redact_argv(shown) == shown  # hiding again changes nothing


@pytest.mark.parametrize(
    "env",
    [
        'env = { HF_TOKEN = "hf_abc", HF_HOME = "llama-3.1-8b", NCCL_ALGO = "Ring" }',
        "[engine.sglang.env]\nHF_TOKEN = '''hf_abc'''\nHF_HOME = 'llama-3.1-8b'\n"
        'NCCL_ALGO = "Ring"',
    ],
)
def test_a_token_or_path_in_env_is_not_recorded(tmp_path: Path, env: str) -> None:
    """What a journal keeps of the campaign (its settings, the file's text) holds no value of
    an env variable it does not compare: a token, a path (here the same text as the model's
    name, which stays); the text still reads as the campaign, with the same hash."""
    text = replace_block(
        SMALL_CAMPAIGN, 'model = "llama-3.1-8b"', f'model = "llama-3.1-8b"\n[engine.sglang]\n{env}'
    )
    campaign = load_text(tmp_path, text)
    assert campaign.operational_dict()["engine.sglang.env"] == {
        "HF_HOME": "(not recorded)",
        "HF_TOKEN": "(not recorded)",
        "NCCL_ALGO": "Ring",
    }
    kept = campaign.recorded_source()
    assert "hf_abc" not in kept
    assert kept.count("llama-3.1-8b") == text.count("llama-3.1-8b") - 1  # HF_HOME's alone
    again = load_text(tmp_path, kept)
    assert again.hash == campaign.hash and again.engine.model == "llama-3.1-8b"
    assert dict(again.engine.sglang.env) == campaign.operational_dict()["engine.sglang.env"]


def test_a_campaign_file_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    # Notepad and other Windows editors save UTF-8 with a BOM; tomllib alone reads the file as
    # "Invalid statement (at line 1, column 1)".
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xef\xbb\xbf" + SMALL_CAMPAIGN.encode())
    campaign = load_campaign(path)
    assert campaign.hash == load_text(tmp_path, SMALL_CAMPAIGN).hash
    assert not campaign.source.startswith("\ufeff")
    # after the mark, a byte that is not UTF-8 is still named on its line
    path.write_bytes(b"\xef\xbb\xbf# ok\n# caf\xe9\n" + SMALL_CAMPAIGN.encode())
    with pytest.raises(CampaignError, match=r"c\.toml is not UTF-8 text \(byte 0xe9 on line 2\)"):
        load_campaign(path)


def test_more_repeats_than_a_journal_reads_back_are_refused(tmp_path: Path) -> None:
    # A campaign asking for more repeats than a journal's stored campaign is read back with
    # (dvfs.records.header's bound on its counts) was measured, then `cube build` refused its
    # journal as edited and said to rerun with --fresh, which measured into the same refusal.
    from dvfs.records.header import RepeatRule

    most = 1 << 20
    asked = "repeats = 2\nprecision = 0.05\nmax_repeats = {}\n"
    fine = load_text(tmp_path, replace_block(SMALL_CAMPAIGN, "repeats = 2\n", asked.format(most)))
    assert RepeatRule.from_json(fine.semantic_dict()["measurement"]).max_repeats == most
    text = replace_block(SMALL_CAMPAIGN, "repeats = 2\n", asked.format(most + 1))
    expect_error(tmp_path, text, "measurement.max_repeats", f"use at most {most}")
    text = replace_block(SMALL_CAMPAIGN, "repeats = 2\n", f"repeats = {most + 1}\n")
    expect_error(tmp_path, text, "measurement.repeats", f"use at most {most}")


@pytest.mark.parametrize(
    ("text", "says"),
    [("", "is empty"), ("\n  \n", "is empty"), ("# to do\n", "holds no settings, only comments")],
)
def test_an_empty_campaign_file_is_said_to_be_empty(tmp_path: Path, text: str, says: str) -> None:
    """An empty campaign file (or one of comments alone) was refused for the first setting it
    lacks, "gpu.profile: the twin needs a GPU profile", as if the rest were there; it is now
    said to be empty, with where to start one."""
    path = write(tmp_path / "c.toml", text)
    with pytest.raises(CampaignError) as caught:
        load_campaign(path)
    message = str(caught.value)
    assert message.startswith(f"campaign file {path} {says}:"), message
    assert "gpu.profile" not in message and "demo.toml" in message, message
