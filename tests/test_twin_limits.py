"""The twin refuses what a real SGLang server refuses: a prompt that with its output does not fit
the model's context length (SGLang answers such a request with an error), and weights too large
for the GPUs (SGLang does not start). `dvfs sweep`, its dry run and `dvfs doctor` say so in
one line before anything runs; a sweep of weights that do not fit fails each server start as
SGLang's would."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import SMALL_CAMPAIGN, replace_block, write

from dvfs.campaign.model import DrafterSpec
from dvfs.cli import cli
from dvfs.clock import VirtualClock
from dvfs.corpora import load_corpus
from dvfs.engines.base import Workload
from dvfs.engines.twin import TwinEngine
from dvfs.errors import EngineError
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.profiles import gpu_profile, model_profile

#: What a campaign whose weights do not fit is told to change: its GPUs (gpu.devices, which
#: engine.tp_size must match where given) or its model.
FIX = "use more GPUs per server (gpu.devices, and engine.tp_size where given) or a smaller model"

#: One cell on the exact twin, no drafter: the smallest campaign that runs a server.
ONE_CELL = replace_block(
    replace_block(
        replace_block(
            replace_block(SMALL_CAMPAIGN, 'profile = "h100-sxm"', 'profile = "h100-sxm:none"'),
            "sm_clock = [1980, 1500, 1005]",
            "sm_clock = [1980]",
        ),
        "power_limit = [700, 300]",
        "power_limit = [700]",
    ),
    'corpora = ["code", "conversation"]',
    'corpora = ["code"]',
)
ONE_CELL = replace_block(ONE_CELL, "batch = [1, 8]", "batch = [1]")
ONE_CELL = replace_block(ONE_CELL, "repeats = 2", "repeats = 1")
#: Its drafters cut to the target alone.
ONE_CELL = re.sub(r"\[drafters\.eagle3\].*?num_draft_tokens = 4\n", "", ONE_CELL, flags=re.S)

#: Gemma-2-9B's context length (its config's max_position_embeddings, google/gemma-2-9b-it):
#: the smallest of the built-in profiles', so a too-long prompt stays a small file.
GEMMA_CONTEXT = 8192


def invoke(*args: str) -> Result:
    """The CLI in process; a refusal is an exit code and a line, never an exception."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _long_corpus_campaign(tmp_path: Path) -> Path:
    """A twin campaign of Gemma-2-9B over a corpus whose prompts are longer than its context
    (the input range admits them whole)."""
    words = "lorem ipsum dolor sit amet consectetur "
    chars = 4 * (GEMMA_CONTEXT + 4000)  # the estimate counts ~4 characters a token
    lines = [
        json.dumps({"text": f"Document {i}: " + words * (chars // len(words))}) for i in range(3)
    ]
    write(tmp_path / "data" / "long.jsonl", "\n".join(lines) + "\n")
    text = replace_block(ONE_CELL, 'model = "llama-3.1-8b"', 'model = "gemma-2-9b"')
    text = replace_block(text, 'corpora = ["code"]', 'corpora = ["long"]')
    text = replace_block(text, "input_tokens = [16, 2048]", "input_tokens = [16, 40000]")
    text += '\n[corpus.long]\npath = "data/long.jsonl"\nfield = "text"\n'
    return write(tmp_path / "long.toml", text)


def _longest_prompt(campaign: Path) -> int:
    spec = {"path": "data/long.jsonl", "field": "text"}
    corpus = load_corpus("long", spec, base_dir=str(campaign.parent))
    return max(p.input_tokens for p in corpus.prompts)


def _context_line(output: str, longest: int) -> None:
    """The one line naming the corpus, its prompt length and the context length."""
    lines = [line for line in output.splitlines() if "context length" in line]
    assert len(lines) == 1, output
    line = lines[0]
    assert "'long'" in line and f"{longest} tokens" in line, output
    assert f"({GEMMA_CONTEXT} tokens)" in line, output
    assert "Traceback" not in output


def test_a_prompt_longer_than_the_context_is_refused_by_sweep_dry_run_and_doctor(
    tmp_path: Path,
) -> None:
    """A corpus of prompts longer than Gemma-2-9B's context: the sweep refuses it before it
    makes a journal (exit 2), its dry run and `dvfs doctor` say the same line (exit 2). Before,
    the twin measured them as if the server had served them."""
    campaign = _long_corpus_campaign(tmp_path)
    longest = _longest_prompt(campaign)
    assert longest > GEMMA_CONTEXT
    out = tmp_path / "out"
    swept = invoke("sweep", str(campaign), "--out", str(out))
    assert swept.exit_code == 2, swept.output
    _context_line(" ".join(swept.output.split()), longest)
    assert not (out / "journal.jsonl").exists()
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 2, dry.output
    problems = json.loads(dry.output)["problems"]
    assert len(problems) == 1, problems
    _context_line(problems[0], longest)
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    assert doctor.exit_code == 2, doctor.output
    failed = [c for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["corpora"], failed
    _context_line(failed[0]["detail"], longest)


@pytest.mark.parametrize(
    ("key", "written"),
    [
        ("measurement.warmup_tokens", "warmup_tokens = 8"),
        ("output_tokens", "output_tokens = 64"),
    ],
)
def test_new_tokens_beyond_the_context_are_refused_with_a_bound_that_is_then_accepted(
    tmp_path: Path, key: str, written: str
) -> None:
    """measurement.warmup_tokens above the model's context (200000 of Llama-3.1-8B's 131072):
    `dvfs doctor` passed the corpora and the dry run found no problem, then the sweep ended in
    "the server reported an error: a prompt of 99 tokens and 200000 new tokens come to ...",
    exit 1, saying nothing of what to change: the warm-up asks the first round's prompts for
    that many tokens. The sweep refuses it before it makes a journal (exit 2), the dry run
    and the doctor alike, naming the key, as output_tokens was. And the bound each names,
    "lower KEY (to at most N)", left the corpus's longer prompts over (N fitted its shortest
    input bound): followed, it was refused again. The bound followed is accepted."""
    text = replace_block(ONE_CELL, written, written.split(" = ")[0] + " = 200000")
    campaign = write(tmp_path / "long.toml", text)
    out = tmp_path / "out"
    swept = invoke("sweep", str(campaign), "--out", str(out))
    assert swept.exit_code == 2, swept.output
    line = " ".join(swept.output.split())
    assert f"with {key} = 200000" in line, line
    found = re.search(rf"lower {re.escape(key)} \(to at most (\d+)\)", line)
    assert found, line
    assert not (out / "journal.jsonl").exists()
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 2 and len(json.loads(dry.output)["problems"]) == 1, dry.output
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    failed = [c["name"] for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert doctor.exit_code == 2 and failed == ["corpora"], doctor.output
    for tokens, code in ((int(found[1]), 0), (int(found[1]) + 1, 2)):
        edited = write(tmp_path / f"at-{tokens}.toml", text.replace("200000", str(tokens)))
        plan = invoke("sweep", str(edited), "--out", str(out), "--dry-run", "--no-estimate")
        assert plan.exit_code == code, plan.output


def test_the_thermal_stabilisations_new_tokens_beyond_the_context_are_refused(
    tmp_path: Path,
) -> None:
    """After each server start (thermal_max_s not 0), the thermal stabilisation runs the first
    round's prompts for at least 64 new tokens, more than output_tokens = 16 and warmup_tokens =
    8 ask: with --context-length 20 tokens past the longest prompt, `dvfs doctor` passed the
    corpora and the dry run found no problem, then the sweep ended in "the server reported an
    error: a prompt of N tokens and 64 new tokens come to ...", exit 1. The sweep refuses it
    before it makes a journal (exit 2), the dry run and the doctor alike, saying what asks
    those tokens and to set thermal_max_s = 0; followed, the sweep measures the cell."""
    longest = max(p.input_tokens for p in load_corpus("code").prompts)
    text = replace_block(ONE_CELL, "input_tokens = [16, 2048]", f"input_tokens = [{longest}, 2048]")
    text = replace_block(text, "output_tokens = 64", "output_tokens = 16")
    text += f'\n[engine.sglang]\nextra_args = ["--context-length", "{longest + 20}"]\n'
    assert "thermal_max_s" not in text  # its default, 120 s
    campaign = write(tmp_path / "stabilise.toml", text)
    out = tmp_path / "out"
    swept = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert swept.exit_code == 2, swept.output
    line = " ".join(swept.output.split())
    assert f"prompts of {longest} tokens" in line, line
    assert "thermal stabilisation's 64 new tokens" in line, line
    assert "set measurement.thermal_max_s = 0" in line, line
    assert not (out / "journal.jsonl").exists()
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 2 and len(json.loads(dry.output)["problems"]) == 1, dry.output
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    failed = [c["name"] for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert doctor.exit_code == 2 and failed == ["corpora"], doctor.output
    followed = write(
        tmp_path / "followed.toml",
        text.replace("[measurement]\n", "[measurement]\nthermal_max_s = 0\n"),
    )
    done = invoke("sweep", str(followed), "--out", str(tmp_path / "out2"), "--no-progress")
    assert done.exit_code == 0, done.output
    assert (tmp_path / "out2" / "cube.nc").is_file()


def test_the_input_bound_the_refusal_names_is_one_the_sweep_then_accepts(tmp_path: Path) -> None:
    """The line's "at most N" for workload.input_tokens is the bound that fits: the dry run of
    the campaign with it finds no problem (and one token more is refused)."""
    campaign = _long_corpus_campaign(tmp_path)
    dry = invoke("sweep", str(campaign), "--out", str(tmp_path / "o"), "--dry-run", "--json")
    found = re.search(r"at most (\d+)", json.loads(dry.output)["problems"][0])
    assert found, dry.output
    bound = int(found[1])
    for upper, problems in ((bound, 0), (bound + 1, 1)):
        text = campaign.read_text().replace("[16, 40000]", f"[16, {upper}]")
        edited = write(tmp_path / f"at-{upper}.toml", text)
        out = tmp_path / f"o{upper}"
        plan = invoke(
            "sweep", str(edited), "--out", str(out), "--dry-run", "--no-estimate", "--json"
        )
        assert len(json.loads(plan.output)["problems"]) == problems, plan.output


def test_in_flight_rounds_longer_than_the_context_are_a_problem_of_the_dry_run(
    tmp_path: Path,
) -> None:
    """An in-flight round asks as many new tokens as its segments need, more than
    output_tokens: prompts that fit Gemma-2-9B's context with output_tokens (so the per-level
    check passes) leave too little of it for one segment at each level. A round is bounded
    by what the context leaves (the server refused every round asking more, and the dry
    run's estimate sweep met that as failed cells); the levels it never reaches would have
    no window, so the dry run refuses the campaign before estimating: a problem line (exit
    2) naming the group, the tokens its segments decode and what the context leaves."""
    words = "lorem ipsum dolor sit amet consectetur "
    chars = 4 * (GEMMA_CONTEXT - 200)  # the estimate counts ~4 characters a token
    lines = [
        json.dumps({"text": f"Document {i}: " + words * (chars // len(words))}) for i in range(3)
    ]
    write(tmp_path / "data" / "long.jsonl", "\n".join(lines) + "\n")
    text = replace_block(ONE_CELL, 'model = "llama-3.1-8b"', 'model = "gemma-2-9b"')
    text = replace_block(text, "sm_clock = [1980]", "sm_clock = [1980, 1500]")
    text = replace_block(text, 'corpora = ["code"]', 'corpora = ["long"]')
    text = replace_block(text, "input_tokens = [16, 2048]", "input_tokens = [16, 40000]")
    text = replace_block(text, "[measurement]\n", '[measurement]\nmode = "in-flight"\n')
    # segments of 2 s: a round's decode of some hundreds of tokens a request at batch 1
    text = replace_block(text, "min_window_s = 0.2", "min_window_s = 2.0")
    text += '\n[corpus.long]\npath = "data/long.jsonl"\nfield = "text"\n'
    campaign = write(tmp_path / "inflight.toml", text)
    longest = _longest_prompt(campaign)
    assert longest + 64 < GEMMA_CONTEXT  # output_tokens fit: the check before it runs passes
    out = tmp_path / "out"
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--json")
    assert dry.exit_code == 2, dry.output
    problems = json.loads(dry.output)["problems"]
    assert len(problems) == 1, problems
    assert "cannot fit one segment at each of the 2 knob levels" in problems[0], problems
    assert "drafter 'none' at batch 1 on corpus 'long'" in problems[0], problems
    assert f"the context ({GEMMA_CONTEXT} tokens)" in problems[0], problems
    assert f"past its longest prompt of {longest} tokens" in problems[0], problems
    assert "\n" not in problems[0]


def _twin_engine(model: str, devices: int = 1) -> TwinEngine:
    clock = VirtualClock()
    profile = gpu_profile("h100-sxm:none")
    node = TwinNode([TwinDevice(profile, clock, i) for i in range(devices)])
    return TwinEngine(node, model_profile(model))


def test_the_twin_engine_answers_a_too_long_prompt_as_the_sglang_client_raises() -> None:
    """The engine itself refuses a round whose prompt and output exceed the context with the
    error the SGLang engine raises for the server's refusal (`EngineError`, so the sweep treats
    both alike), in a line naming the prompt's length and the context length; a prompt that
    fits runs. An EAGLE drafter's reserved draft slots count against the context, as SGLang
    counts them."""
    from dvfs.twin.limits import context_refusal

    corpus = load_corpus("code")
    prompt = corpus.prompts[0]
    fits = GEMMA_CONTEXT - prompt.input_tokens
    with _twin_engine("gemma-2-9b") as engine:
        engine.start(DrafterSpec("none"))
        engine.run(Workload(1, (prompt,), "code", fits, 0.0, True))
        with pytest.raises(EngineError, match=rf"context length \({GEMMA_CONTEXT} tokens\)"):
            engine.run(Workload(1, (prompt,), "code", fits + 1, 0.0, True))
        eagle = DrafterSpec("eagle", "EAGLE", num_steps=3, eagle_topk=1, num_draft_tokens=4)
        engine.start(eagle)
        with pytest.raises(EngineError, match=str(prompt.input_tokens + 4)):
            engine.run(Workload(1, (prompt,), "code", fits, 0.0, True))
    assert context_refusal(GEMMA_CONTEXT, 2, GEMMA_CONTEXT) is not None  # the input alone
    assert context_refusal(GEMMA_CONTEXT - 2, 2, GEMMA_CONTEXT) is None  # both, exactly


#: A 70B-shaped model: BF16 weights of ~131 GiB, more than one H100 (80 GB) holds.
BIG = replace_block(ONE_CELL, 'model = "llama-3.1-8b"', 'model = "llama-3.1-70b"')

#: What the closing line of a sweep whose servers SGLang would not start says instead of a rerun.
NOT_STARTED = "SGLang would not start the server of drafter 'none' for the campaign as it is"


def test_a_70b_model_on_one_h100_is_refused_before_running_and_fails_its_server_start(
    tmp_path: Path,
) -> None:
    """Llama-3.1-70B's weights on one H100: `dvfs doctor` and the dry run refuse the campaign
    (exit 2) in one line naming the model, the GiB needed and available, and what to do; the
    sweep's server fails to start as SGLang's would, said in one line, its cell failed. Before,
    the twin measured it."""
    campaign = write(tmp_path / "big.toml", BIG)
    out = tmp_path / "out"
    needed = re.compile(
        r"Llama-3\.1-70B-Instruct does not fit: its weights need 131\.4 GiB per GPU \(tp 1\) "
        r"but NVIDIA H100 80GB HBM3 has [\d.]+ GiB .*use more GPUs per server \(gpu\.devices, "
        r"and engine\.tp_size where given\) or a smaller model"
    )
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    assert doctor.exit_code == 2, doctor.output
    failed = [c for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["engine"], failed
    assert needed.search(failed[0]["detail"]), failed
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--json")
    assert dry.exit_code == 2, dry.output
    plan = json.loads(dry.output)
    assert len(plan["problems"]) == 1 and needed.search(plan["problems"][0]), plan["problems"]
    swept = invoke("sweep", str(campaign), "--out", str(out))
    assert swept.exit_code == 5, swept.output  # cells failed
    said = " ".join(swept.output.split())
    assert "drafter 'none': " in said and needed.search(said), swept.output
    assert "0 cell(s) measured, 1 failed" in said, swept.output


def test_a_70b_model_fits_four_h100s_with_tensor_parallelism(tmp_path: Path) -> None:
    """The same model on four H100s with tp 4 (a quarter of the weights each): doctor finds
    the engine fine, and the sweep measures its cell."""
    text = replace_block(BIG, "devices = [0]", "devices = [0, 1, 2, 3]")
    text = replace_block(text, 'model = "llama-3.1-70b"', 'model = "llama-3.1-70b"\ntp_size = 4')
    campaign = write(tmp_path / "big4.toml", text)
    out = tmp_path / "out"
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    checks = {c["name"]: c["status"] for c in json.loads(doctor.output)}
    assert checks["engine"] == "ok", doctor.output
    swept = invoke("sweep", str(campaign), "--out", str(out))
    assert swept.exit_code == 0, swept.output
    assert "1 cell(s) measured, 0 failed" in " ".join(swept.output.split()), swept.output


def test_the_weights_per_gpu_count_the_draft_model_and_divide_over_the_ranks() -> None:
    """What SGLang 0.5.23 counts: the target's and the draft model's weights together (a
    standalone drafter's whole; a head's without the embeddings it takes from its target),
    divided over the tensor-parallel ranks, against the GPU's memory times its default static
    fraction."""
    from dvfs.twin.limits import weights_refusal

    h100 = gpu_profile("h100-sxm")
    target = model_profile("llama-3.1-70b")
    assert weights_refusal(target, None, h100, 1) is not None
    assert weights_refusal(target, None, h100, 4) is None
    small = model_profile("llama-3.1-8b")
    assert weights_refusal(small, model_profile("llama-3.2-1b"), h100, 1) is None
    # tp 2: 65.7 GiB of 70B weights per GPU just fit an H100 alone; a 70B standalone drafter
    # beside them does not
    assert weights_refusal(target, None, h100, 2) is None
    refusal = weights_refusal(target, target, h100, 2)
    assert refusal is not None and "with draft model" in refusal


#: The static memory fraction set by the campaign's SGLang args, too small for an 8B model:
#: as the flag, and as an abbreviation SGLang's argparse reads as it.
SGLANG_FRACTIONS = ('["--mem-fraction-static", "0.15"]', '["--mem=0.15"]')


@pytest.mark.parametrize("args", SGLANG_FRACTIONS)
def test_a_mem_fraction_the_campaign_sets_is_the_one_checked_before_and_at_the_start(
    tmp_path: Path, args: str
) -> None:
    """`--mem-fraction-static` in engine.sglang.extra_args sizes the static memory instead of
    SGLang's default, for `dvfs doctor` and the twin's server start alike: an 8B model that
    fits one H100 at the default does not at 0.15 (15 GiB of weights, 12 GiB there)."""
    campaign = write(tmp_path / "frac.toml", _with_engine_args(args))
    out = tmp_path / "out"
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    failed = [c for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["engine"], doctor.output
    assert "0.15, the campaign's --mem-fraction-static" in failed[0]["detail"], failed
    # the way out it names first is the fraction: at least the weights' share of the memory
    least = re.search(r"raise --mem-fraction-static to at least ([\d.]+)", failed[0]["detail"])
    assert least, failed
    raised = write(tmp_path / "raised.toml", _with_engine_args(f'["--mem={least[1]}"]'))
    fits = invoke("doctor", str(raised), "--out", str(tmp_path / "o3"), "--json")
    assert {c["name"]: c["status"] for c in json.loads(fits.output)}["engine"] == "ok"
    swept = invoke("sweep", str(campaign), "--out", str(out))
    said = " ".join(swept.output.split())
    assert "drafter 'none': " in said and "0.15, the campaign's" in said, swept.output
    default = write(tmp_path / "default.toml", ONE_CELL)
    fine = invoke("doctor", str(default), "--out", str(tmp_path / "o2"), "--json")
    assert {c["name"]: c["status"] for c in json.loads(fine.output)}["engine"] == "ok"


def _with_engine_args(args: str, env: str = "") -> str:
    """ONE_CELL with `args` (a TOML list) as engine.sglang.extra_args, `env` its env table."""
    table = f"[engine.sglang]\nextra_args = {args}\n{env}"
    return replace_block(ONE_CELL, "[drafters.none]", table + "\n[drafters.none]")


def test_a_context_length_the_campaign_sets_is_the_one_its_prompts_must_fit(
    tmp_path: Path,
) -> None:
    """`--context-length` in engine.sglang.extra_args (SGLang serves that context instead of
    the model's): prompts of the code corpus longer than it are refused by the sweep (exit 2,
    no journal), its dry run and `dvfs doctor`, in one line naming it; and the twin engine
    started with it answers such a round as the SGLang client raises. Before, the twin
    measured them as if the server had served them."""
    campaign = write(tmp_path / "ctx.toml", _with_engine_args('["--context-length", "300"]'))
    out = tmp_path / "out"
    swept = invoke("sweep", str(campaign), "--out", str(out))
    assert swept.exit_code == 2, swept.output
    said = " ".join(swept.output.split())
    assert "corpus 'code' has prompts of" in said and "--context-length 300" in said, said
    assert not (out / "journal.jsonl").exists()
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 2, dry.output
    problems = json.loads(dry.output)["problems"]
    assert len(problems) == 1 and "--context-length 300" in problems[0], problems
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    failed = [c for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["corpora"], failed
    assert "--context-length 300" in failed[0]["detail"], failed
    assert "or raise --context-length (the model's is 131072)" in failed[0]["detail"], failed
    prompt = max(load_corpus("code").prompts, key=lambda p: p.input_tokens)
    assert prompt.input_tokens >= 300
    engine = _twin_engine("llama-3.1-8b")
    engine.server_args = ("--context-l=300",)  # an abbreviation SGLang's argparse reads too
    with engine:
        engine.start(DrafterSpec("none"))
        with pytest.raises(EngineError, match=r"context length \(300 tokens\)"):
            engine.run(Workload(1, (prompt,), "code", 16, 0.0, True))


def test_a_context_length_above_the_model_s_is_refused_as_sglang_refuses_to_start(
    tmp_path: Path,
) -> None:
    """A `--context-length` above Llama-3.1-8B's 131072 tokens: SGLang refuses to start unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set, so `dvfs doctor` and the dry run refuse
    the campaign (exit 2) in one line saying both ways out, and the sweep's server start fails;
    with the variable in engine.sglang.env, doctor finds the engine fine."""
    args = '["--context-length", "200000"]'
    campaign = write(tmp_path / "long.toml", _with_engine_args(args))
    out = tmp_path / "out"
    line = re.compile(
        r"--context-length 200000 is above the context length of "
        r"meta-llama/Llama-3\.1-8B-Instruct \(131072 tokens\).*give at most 131072, or set "
        r"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 in engine\.sglang\.env"
    )
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    assert doctor.exit_code == 2, doctor.output
    failed = [c for c in json.loads(doctor.output) if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["engine"] and line.search(failed[0]["detail"]), failed
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 2, dry.output
    problems = json.loads(dry.output)["problems"]
    assert len(problems) == 1 and line.search(problems[0]), problems
    swept = invoke("sweep", str(campaign), "--out", str(out))
    assert swept.exit_code == 5 and line.search(" ".join(swept.output.split())), swept.output
    env = 'env = { SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = "1" }\n'
    allowed = write(tmp_path / "allowed.toml", _with_engine_args(args, env))
    fine = invoke("doctor", str(allowed), "--out", str(tmp_path / "o2"), "--json")
    assert {c["name"]: c["status"] for c in json.loads(fine.output)}["engine"] == "ok"
    # the closing line's way out by the environment resumes the journal, as it says
    said = " ".join(swept.output.split())
    assert f"they failed as {NOT_STARTED}" in said and "rerun the same command to" not in said
    assert "a change to engine.sglang.env alone resumes it: then rerun the same command" in said
    resumed = invoke("sweep", str(allowed), "--out", str(out))
    assert resumed.exit_code == 0, resumed.output
    assert "1 cell(s) measured, 0 failed" in " ".join(resumed.output.split()), resumed.output


def _on_hardware(text: str) -> str:
    """`text` as a hardware campaign (NVML GPUs, a real SGLang server) whose dry run estimates
    its GPU time on the twin stand-in its gpu.profile names."""
    text = replace_block(text, 'backend = "twin"\nprofile', 'backend = "nvml"\nprofile')
    return replace_block(text, '[engine]\nbackend = "twin"', '[engine]\nbackend = "sglang"')


@pytest.mark.parametrize("problem", ["weights", "context"])
def test_a_hardware_campaign_s_estimate_is_refused_where_its_twin_stand_in_would_be(
    tmp_path: Path, problem: str
) -> None:
    """The dry run of a hardware campaign sweeps its twin stand-in for the GPU-time estimate:
    a stand-in whose servers would not start (a 70B model on one H100) or whose corpus the
    model has no room for is a problem in one line (exit 2), not an estimate of cells that all
    fail nor a refusal from inside the estimate's sweep."""
    if problem == "weights":
        campaign = write(tmp_path / "hw.toml", _on_hardware(BIG))
        said = "Llama-3.1-70B-Instruct does not fit"
    else:
        campaign = _long_corpus_campaign(tmp_path)
        campaign.write_text(_on_hardware(campaign.read_text()))
        said = f"context length of google/gemma-2-9b-it ({GEMMA_CONTEXT} tokens)"
    dry = invoke("sweep", str(campaign), "--out", str(tmp_path / "o"), "--dry-run", "--json")
    assert dry.exit_code == 2, dry.output
    plan = json.loads(dry.output)
    assert len(plan["problems"]) == 1, plan["problems"]
    assert plan["problems"][0].startswith("on the twin stand-in h100-sxm"), plan["problems"]
    assert said in plan["problems"][0], plan["problems"]


@pytest.mark.parametrize(
    ("gpus", "fixed_gpus"), [((), ()), (("--gpus", "0-1"), ("--gpus", "0-7"))], ids=["one", "fleet"]
)
def test_cells_sglang_would_not_start_say_to_change_the_campaign_not_to_rerun_it(
    tmp_path: Path, gpus: tuple[str, ...], fixed_gpus: tuple[str, ...]
) -> None:
    """Llama-3.1-70B on one H100, swept by one server or a fleet of two: the closing line
    says that its failed cells need a changed campaign (what the refusal says to change),
    run with --fresh or another --out, not the same command again, which fails them alike.
    Followed (tp 4 on four GPUs): resumed into the same folder it is refused for its other
    settings, with --fresh it measures the cell. Before, the line said "rerun the same command
    to retry them"."""
    campaign = write(tmp_path / "big.toml", BIG)
    out = tmp_path / "out"
    for _ in range(2):  # the same command again: the same failure, the same line
        swept = invoke("sweep", str(campaign), "--out", str(out), *gpus)
        assert swept.exit_code == 5, swept.output
        said = " ".join(swept.output.split())
        assert "0 cell(s) measured, 1 failed" in said, said
        assert "rerun the same command" not in said, said
        assert f"they failed as {NOT_STARTED}" in said, said
        assert f"change the campaign ({FIX})" in said, said
        assert "then run it with --fresh" in said and "with another --out folder" in said, said
    text = replace_block(BIG, "devices = [0]", "devices = [0, 1, 2, 3]")
    text = replace_block(text, 'model = "llama-3.1-70b"', 'model = "llama-3.1-70b"\ntp_size = 4')
    fixed = write(tmp_path / "big4.toml", text)
    resumed = invoke("sweep", str(fixed), "--out", str(out), *fixed_gpus)
    assert resumed.exit_code == 1, resumed.output
    assert "engine.tp_size: 1 -> 4" in resumed.output and "--fresh" in resumed.output
    fresh = invoke("sweep", str(fixed), "--out", str(out), "--fresh", *fixed_gpus)
    assert fresh.exit_code == 0, fresh.output
    assert "1 cell(s) measured, 0 failed" in " ".join(fresh.output.split()), fresh.output


@pytest.mark.parametrize("mode", ["per-level", "in-flight"])
def test_only_the_drafter_whose_draft_model_does_not_fit_is_named_for_a_changed_campaign(
    tmp_path: Path, mode: str
) -> None:
    """Llama-3.1-8B, which fits one H100, with a standalone drafter whose draft model (a 70B)
    does not fit beside it: the target's cells are measured, the drafter's fail, and the
    closing line names that drafter alone for a changed campaign, per level and in flight."""
    text = ONE_CELL.replace(
        "[workload]",
        '[drafters.big]\nalgorithm = "STANDALONE"\ndraft_model = "llama-3.1-70b"\n'
        "num_steps = 3\neagle_topk = 1\nnum_draft_tokens = 4\n\n[workload]",
    )
    if mode == "in-flight":
        text = replace_block(text, "sm_clock = [1980]", "sm_clock = [1980, 1500]")
        text = replace_block(text, "[measurement]\n", '[measurement]\nmode = "in-flight"\n')
    campaign = write(tmp_path / "draft.toml", text)
    swept = invoke("sweep", str(campaign), "--out", str(tmp_path / "out"))
    assert swept.exit_code == 5, swept.output
    said = " ".join(swept.output.split())
    levels = 2 if mode == "in-flight" else 1
    assert f"{levels} cell(s) measured, {levels} failed" in said, said
    assert "they failed as SGLang would not start the server of drafter 'big' for" in said, said
    assert "rerun the same command" not in said, said


def test_the_closing_advice_parts_the_cells_a_rerun_retries_from_those_it_does_not() -> None:
    """Failed cells of both kinds: those SGLang would not start the server of are told to
    change the campaign, the others to rerun the same command (without --fresh, where given)."""
    from dvfs.cli.sweep import _failed_advice
    from dvfs.measure.runner import RunSummary

    fix = FIX
    summary = RunSummary(5, 0, 2, 3, ("a", "b", "c"), 0, (), 2, ("big",), (fix,))
    said = _failed_advice(summary, fresh=False)
    assert said.startswith("2 of them failed as SGLang would not start the server of drafter")
    assert f"change the campaign ({fix})" in said
    assert said.endswith("; the other 1: rerun the same command to retry them"), said
    again = _failed_advice(summary, fresh=True)
    assert "run it again with --fresh" in again
    assert again.endswith("without --fresh to retry them (with it, every cell is measured again)")
    plain = RunSummary(5, 0, 2, 3, ("a", "b", "c"))
    assert _failed_advice(plain, fresh=False) == "rerun the same command to retry them"


def test_cube_info_headroom_and_compare_say_to_change_the_campaign_for_cells_sglang_would_not_start(
    tmp_path: Path,
) -> None:
    """The drafter whose draft model does not fit beside the target: the sweep's closing line
    says to change the campaign, and so do `dvfs cube info` (text and --json `resume`), the
    headroom table (its partial-cube note and the row without a reference) and `dvfs compare`,
    not "run the same `dvfs sweep` command again", which fails the cells again. With other
    cells left too (one failed otherwise), those are still told to rerun the same command.
    Before, every one of them said to rerun the same command."""
    from dvfs.cube import open_analysable
    from dvfs.cube.schema import STATUS_FAILED

    text = ONE_CELL.replace(
        "[workload]",
        '[drafters.big]\nalgorithm = "STANDALONE"\ndraft_model = "llama-3.1-70b"\n'
        "num_steps = 3\neagle_topk = 1\nnum_draft_tokens = 4\n\n[workload]",
    )
    out = tmp_path / "out"
    swept = invoke("sweep", str(write(tmp_path / "draft.toml", text)), "--out", str(out))
    assert swept.exit_code == 5, swept.output
    change = f"change the campaign ({FIX})"
    rerun = "run the same `dvfs sweep` command again"
    info = json.loads(invoke("cube", "info", str(out), "--json").output)
    assert change in info["resume"] and rerun not in info["resume"], info["resume"]
    assert "drafter 'big'" in info["resume"] and "--fresh" in info["resume"], info["resume"]
    for args in (("cube", "info"), ("headroom",), ("compare",)):
        said = " ".join(invoke(*args, str(out)).output.split())
        assert change in said and rerun not in said, (args, said)
    doc = json.loads(invoke("headroom", str(out), "--json").output)
    (row,) = [r for r in doc["rows"] if not r["feasible"]]
    assert row["drafter"] == "big" and row["reference_problem"] == "failed", row
    # another cell left besides (one failed otherwise): that one is still retried by a rerun
    from dvfs.cube.cells_left import resume_note, unfit_left

    cube = open_analysable(out).load()
    status = cube["cell_status"].copy()
    status.loc[{"drafter": "none"}] = STATUS_FAILED
    left = unfit_left(cube.assign(cell_status=status))
    assert left["unfit"]["drafters"] == ["big"] and left["unfit"]["others"] == 1, left
    note = resume_note(left)
    assert note.startswith("the cells of drafter 'big' failed as SGLang would not start"), note
    assert change in note and note.endswith(
        f"for the other 1 cell(s) left: {rerun} without --fresh (which starts over) to resume it"
    ), note
    assert resume_note(unfit_left(cube.assign_attrs(failed_cells="[]"))).startswith(rerun)
    # a cube merged from sweeps: each changed sweep's cube merged again
    merged = resume_note({**unfit_left(cube), "merged_cubes": ["a", "b"]})
    assert change in merged and merged.endswith("`dvfs cube merge` the cubes again"), merged


def test_a_merged_cube_tells_the_gpu_sglang_would_not_start_on_from_one_a_rerun_retries(
    tmp_path: Path,
) -> None:
    """A fleet of an H100 and an H200 at a --mem-fraction-static the 8B model fits only the
    H200 at: the H100's cell failed as SGLang would not start its server, and its row is told
    to change the campaign; the H200's cell of the same drafter, failed otherwise (edited in),
    is still a cell a rerun retries, and its row says so. Before, every failed cell of that
    drafter read as one SGLang would not start, on either GPU."""
    from dvfs.cube import open_analysable, write_cube
    from dvfs.cube.cells_left import resume_note, unfit_left
    from dvfs.cube.schema import STATUS_FAILED

    text = _with_engine_args('["--mem-fraction-static", "0.15"]')
    campaign = write(tmp_path / "frac.toml", replace_block(text, "batch = [1]", "batch = [1, 8]"))
    out = tmp_path / "out"
    swept = invoke("sweep", str(campaign), "--out", str(out), "--gpus", "0,h200-sxm:0")
    assert swept.exit_code == 5, swept.output
    cube = open_analysable(out).load()
    names = json.loads(cube.attrs["gpu_names"])
    h100, h200 = (str(cube["gpu"].values[names.index(n)]) for n in sorted(names))
    status = cube["cell_status"].copy()
    status.loc[{"gpu": h200, "batch": 1}] = STATUS_FAILED
    edited = cube.assign(cell_status=status)
    path = write_cube(edited, tmp_path / "edited.nc")
    said = " ".join(invoke("headroom", str(path)).output.split())
    assert "change the campaign (raise --mem-fraction-static to at least" in said, said
    assert "it retries failed cells" in said, said
    note = resume_note(unfit_left(edited))
    assert note.endswith(
        "for the other 1 cell(s) left: run the same `dvfs sweep` command "
        "again without --fresh (which starts over) to resume it"
    ), note
    left = unfit_left(cube)["unfit"]
    assert left["on"] == {"none": [h100]} and left["others"] == 0, left


def _swept_wide_with_an_unfit_drafter(tmp_path: Path) -> Path:
    """ONE_CELL over 201 power limits with a drafter whose 70B draft model does not fit,
    swept (exit 5: its 201 cells failed): the folder."""
    text = ONE_CELL.replace(
        "[workload]",
        '[drafters.big]\nalgorithm = "STANDALONE"\ndraft_model = "llama-3.1-70b"\n'
        "num_steps = 3\neagle_topk = 1\nnum_draft_tokens = 4\n\n[workload]",
    )
    limits = ", ".join(str(w) for w in range(300, 701, 2))  # 201 power limits
    text = replace_block(text, "power_limit = [700]", f"power_limit = [{limits}]")
    out = tmp_path / "out"
    swept = invoke("sweep", str(write(tmp_path / "wide.toml", text)), "--out", str(out))
    assert swept.exit_code == 5, swept.output
    return out


def test_cells_sglang_would_not_start_are_told_past_the_200_failed_cells_a_cube_lists(
    tmp_path: Path,
) -> None:
    """A cube lists its first 200 failed cells: where 201 cells of the target alone failed
    otherwise (a crash, edited into the journal) ahead of the drafter whose draft model does
    not fit, that drafter's cells are still told to change the campaign, not counted among
    the cells a rerun retries. Before, `dvfs cube info` had no `unfit` and said to rerun the
    same command for all of them, which fails the drafter's cells again."""
    out = _swept_wide_with_an_unfit_drafter(tmp_path)
    head: list[str] = []
    crashed: list[str] = []
    unfit: list[str] = []
    for line in (out / "journal.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") != "cell":
            head.append(line)
        elif record["cell"]["drafter"] == "none":
            record.pop("measurement", None)
            crashed.append(json.dumps({**record, "status": "failed", "error": "server crashed"}))
        else:
            unfit.append(line)
    assert len(crashed) == 201 and len(unfit) == 201
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "journal.jsonl").write_text("\n".join(head + crashed + unfit) + "\n")
    assert invoke("cube", "build", str(edited)).exit_code == 0
    info = json.loads(invoke("cube", "info", str(edited), "--json").output)
    assert info["unfit"]["drafters"] == ["big"] and info["unfit"]["others"] == 201, info["unfit"]
    assert info["resume"].startswith("the cells of drafter 'big' failed as SGLang"), info["resume"]
    assert info["resume"].endswith(
        "for the other 201 cell(s) left: run the same `dvfs sweep` "
        "command again without --fresh (which starts over) to resume it"
    )


def test_shards_of_a_fleet_merged_tell_their_cells_sglang_would_not_start_by_the_gpu_label(
    tmp_path: Path,
) -> None:
    """Two shards, each a fleet of an H100 and an H200 at a --mem-fraction-static the 8B model
    fits only the H200 at, merged: the H100s' label is both UUIDs, each shard's failed cell
    names its own H100; those cells are still told to change the campaign, none counted among
    the cells a rerun retries, and `dvfs cube merge`'s note says so too. Before, cube info said
    "for the other 2 cell(s) left", the headroom rows said to rerun the shards and the merge's
    note to resume each shard, which fails the cells again."""
    text = _with_engine_args('["--mem-fraction-static", "0.15"]')
    campaign = write(tmp_path / "frac.toml", replace_block(text, "batch = [1]", "batch = [1, 8]"))
    shards = []
    for i in range(2):
        out = tmp_path / f"shard{i}"
        gpus = f"{i},h200-sxm:{i}"
        swept = invoke(
            "sweep", str(campaign), "--out", str(out), "--gpus", gpus, "--shard", f"{i}/2"
        )
        assert swept.exit_code == 5, swept.output
        shards.append(str(out))
    merged = tmp_path / "merged.nc"
    merging = invoke("cube", "merge", *shards, "-o", str(merged))
    assert merging.exit_code == 0, merging.output
    note = " ".join(merging.output.split())
    assert "resume each with" not in note and "change the campaign (raise" in note, note
    assert note.endswith("`dvfs cube merge` the cubes again"), note
    info = json.loads(invoke("cube", "info", str(merged), "--json").output)
    assert info["unfit"]["others"] == 0, info["unfit"]
    assert "for the other" not in info["resume"], info["resume"]
    said = " ".join(invoke("headroom", str(merged)).output.split())
    assert "rerun the unfinished shards" not in said, said
    assert "change the campaign (raise --mem-fraction-static to at least" in said, said


def test_a_cube_of_cells_sglang_would_not_start_alone_is_refused_with_the_change_to_make(
    tmp_path: Path,
) -> None:
    """Every cell failed as SGLang would not start the 8B model's server at a
    --mem-fraction-static too low for it: the analyses' refusal says to change the campaign
    and sweep with --fresh. Before, it said to rerun `dvfs sweep`, which fails them again."""
    text = _with_engine_args('["--mem-fraction-static", "0.15"]')
    out = tmp_path / "out"
    swept = invoke("sweep", str(write(tmp_path / "frac.toml", text)), "--out", str(out))
    assert swept.exit_code == 5, swept.output
    said = " ".join(invoke("headroom", str(out)).output.split())
    assert "has no valid measured cell" in said and "rerun `dvfs sweep`" not in said, said
    assert "change the campaign (raise --mem-fraction-static to at least" in said, said
    assert said.endswith("then sweep again with --fresh or into another --out folder"), said


def test_cube_info_counts_the_failed_cells_past_the_200_its_list_keeps(tmp_path: Path) -> None:
    """201 cells of a drafter whose draft model does not fit failed: the cube lists 200 of
    them (`FAILED_CELLS_CAP`); `dvfs cube info` shows 5 and says "... and 196 more failed
    cells", counted from the cube's cells. Before, it counted the list and said 195."""
    out = _swept_wide_with_an_unfit_drafter(tmp_path)
    info = json.loads(invoke("cube", "info", str(out), "--json").output)
    assert info["failed"] == 201 and len(info["failed_cells"]) == 200, info["failed"]
    said = " ".join(invoke("cube", "info", str(out)).output.split())
    assert "... and 196 more failed cells" in said, said


def test_a_fleet_of_two_gpu_models_is_told_its_journals_move_aside(tmp_path: Path) -> None:
    """A fleet of an H100 and an H200 at a --mem-fraction-static the 8B model fits only the
    H200 at: the cell SGLang would not start on the H100 is told to change the campaign and
    sweep with --fresh, which moves the folder's two journals (one per GPU model) aside.
    Before, the closing line spoke of "this journal", as a sweep of one journal does."""
    campaign = write(tmp_path / "frac.toml", _with_engine_args('["--mem-fraction-static", "0.15"]'))
    swept = invoke("sweep", str(campaign), "--out", str(tmp_path / "out"), "--gpus", "0,h200-sxm:0")
    assert swept.exit_code == 5, swept.output
    said = " ".join(swept.output.split())
    assert "with --fresh (which moves these journals aside" in said, said
    assert "cannot resume these journals." in said and "this journal" not in said, said


def test_shards_told_to_change_the_campaign_are_told_to_sweep_every_shard_with_fresh(
    tmp_path: Path,
) -> None:
    """Two shards at a --mem-fraction-static the 8B model does not fit an H100 at, merged:
    the merge's note and `dvfs cube info` of the merged cube say to change the campaign and
    run every shard again with --fresh, as `dvfs cube merge` merges the shards of one campaign
    alone. Before, they said "sweep again with --fresh", as to a sweep of its own, which leaves
    the shards that measured their cells under the old campaign, refused by the merge."""
    text = _with_engine_args('["--mem-fraction-static", "0.15"]')
    campaign = write(tmp_path / "frac.toml", replace_block(text, "batch = [1]", "batch = [1, 8]"))
    shards = []
    for i in range(2):
        out = tmp_path / f"shard{i}"
        swept = invoke("sweep", str(campaign), "--out", str(out), "--shard", f"{i}/2")
        assert swept.exit_code == 5, swept.output
        shards.append(str(out))
    merged = tmp_path / "merged.nc"
    merging = invoke("cube", "merge", *shards, "-o", str(merged))
    assert merging.exit_code == 0, merging.output
    info = json.loads(invoke("cube", "info", str(merged), "--json").output)
    every = (
        "then run every shard again with --fresh or into other --out folders (a changed "
        "campaign needs it on each shard, not only where the cells failed"
    )
    for said in (" ".join(merging.output.split()), info["resume"]):
        assert every in said and "then sweep again with --fresh" not in said, said
        assert said.endswith("then `dvfs cube merge` the cubes again"), said


def test_a_shards_sweep_told_to_change_the_campaign_is_told_every_shard_sweeps_again(
    tmp_path: Path,
) -> None:
    """Shard 0/2 at a --mem-fraction-static the 8B model does not fit an H100 at: its closing
    line says to change the campaign and run every shard again with --fresh, not this one
    alone, as `dvfs cube merge` merges the shards of one campaign alone."""
    text = _with_engine_args('["--mem-fraction-static", "0.15"]')
    campaign = write(tmp_path / "frac.toml", replace_block(text, "batch = [1]", "batch = [1, 8]"))
    swept = invoke("sweep", str(campaign), "--out", str(tmp_path / "s0"), "--shard", "0/2")
    assert swept.exit_code == 5, swept.output
    said = " ".join(swept.output.split())
    assert (
        "cannot resume this journal; run every shard so (with --fresh or another --out folder), "
        "not only this one: `dvfs cube merge` merges the shards of one campaign alone"
    ) in said, said
