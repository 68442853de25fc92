"""What keeps the arms of an SGLang comparison comparable: the same attention kernels for every
drafter, the metered GPU and no other, managed flags that extra_args cannot override, requests
with real deadlines, and a server that never outlives a failed check or a killed dvfs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sglang_support import load_stub, running, stub_campaign

import dvfs
from dvfs.campaign import load_campaign, parse_campaign
from dvfs.cli import cli
from dvfs.clock import MonotonicClock
from dvfs.engines.sglang import SglangEngine, dying_with_parent
from dvfs.engines.sglang_args import (
    MANAGED_FLAGS,
    Kernels,
    check_same_kernels,
    given_page_size,
    launch_argv,
    managed_flag,
    predicted_attention_backend,
    server_env,
)
from dvfs.errors import CampaignError, EngineError

REPO = Path(__file__).resolve().parent.parent
VERSIONS = ("0.5.9", "0.5.23")
TABLES = REPO / "tests" / "data" / "sglang-args"
ONE_DRAFTER = '\n[drafters.none]\nalgorithm = "none"\n'


@pytest.fixture(scope="module")
def stub() -> ModuleType:
    return load_stub()


def _resolve(stub: ModuleType, version: str, *argv: str) -> dict[str, Any]:
    args, _ = stub.parse_launch_argv(["--model-path", "m", *argv], stub.StubConfig(version=version))
    return dict(args)


def _campaign_text(engine_extra: str = "", drafters: str = ONE_DRAFTER, gpu: str = "") -> str:
    return f"""
[gpu]
backend = "twin"
profile = "h100-sxm"
{gpu}

[engine]
backend = "sglang"
model = "m"

[engine.sglang]
{engine_extra}
{drafters}

[workload]
batch = [1]
corpora = ["code"]
"""


def one_clock_sweep(tmp_path: Path, **campaign: Any) -> tuple[Result, Path, str]:
    """`dvfs sweep` of a stub campaign at batch 1 and one clock (`stub_campaign`'s other
    settings as given) into tmp_path/out: the result, the folder and the servers' marker."""
    path, marker = stub_campaign(
        tmp_path, batch="[1]", knobs="sm_clock = [1980]\nsettle_s = 0.0", **campaign
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    return result, out, marker


def _load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_campaign(path)


# -- 1. attention backend --------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_stub_resolves_the_attention_backend_like_sglang_on_hopper(
    stub: ModuleType, version: str
) -> None:
    """Left alone, SGLang picks fa3 except for EAGLE trees (topk > 1): flashinfer."""
    eagle = ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d")
    triple = ("--speculative-num-steps", "5", "--speculative-num-draft-tokens", "8")
    cases: list[tuple[tuple[str, ...], str]] = [
        ((), "fa3"),
        ((*eagle, *triple, "--speculative-eagle-topk", "4"), "flashinfer"),
        ((*eagle, *triple, "--speculative-eagle-topk", "1"), "fa3"),
        ((*eagle,), "fa3"),  # decided before SGLang fills in its own (topk > 1) defaults
        (("--speculative-algorithm", "NGRAM"), "fa3"),  # its topk is set afterwards
        (("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d"), "fa3"),
        # topk 1 with pages > 1 leaves fa3 too; no speculation keeps it.
        ((*eagle, *triple, "--speculative-eagle-topk", "1", "--page-size", "16"), "flashinfer"),
        (("--page-size", "16"), "fa3"),
        # A pinned backend is kept, also for EAGLE trees.
        ((*eagle, *triple, "--speculative-eagle-topk", "4", "--attention-backend", "fa3"), "fa3"),
        # fa3 cannot hold an fp8_e5m2 KV cache: SGLang swaps in triton.
        (("--attention-backend", "fa3", "--kv-cache-dtype", "fp8_e5m2"), "triton"),
    ]
    if version == "0.5.23":
        cases.append(
            (("--speculative-algorithm", "DFLASH", "--speculative-draft-model", "d"), "fa3")
        )
    for argv, expected in cases:
        args = _resolve(stub, version, *argv)
        assert args["attention_backend"] == expected, argv
        assert Kernels.from_args(args).label == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_every_drafter_is_launched_and_resolved_on_the_pinned_backend(
    stub: ModuleType, version: str
) -> None:
    campaign = load_campaign(REPO / "sweeps" / "h100-llama8b.toml")
    assert campaign.engine.sglang.attention_backend == "fa3"  # the documented default
    kernels = {}
    for drafter in campaign.drafters:
        if version == "0.5.9" and drafter.algorithm == "DFLASH":
            continue
        argv = launch_argv(campaign, drafter, port=31000, version=version)
        assert argv[argv.index("--attention-backend") + 1] == "fa3"
        args, _ = stub.parse_launch_argv(argv[3:], stub.StubConfig(version=version))
        kernels[drafter.name] = Kernels.from_args(args)
    check_same_kernels(kernels, "fa3")
    # Left to SGLang, the EAGLE-3 tree (topk 4) would run flashinfer and the others fa3.
    auto = dataclasses.replace(
        campaign,
        engine=dataclasses.replace(
            campaign.engine,
            sglang=dataclasses.replace(campaign.engine.sglang, attention_backend="auto"),
        ),
    )
    unpinned = {}
    for drafter in auto.drafters:
        if version == "0.5.9" and drafter.algorithm == "DFLASH":
            continue
        argv = launch_argv(auto, drafter, port=31000, version=version)
        assert "--attention-backend" not in argv
        args, _ = stub.parse_launch_argv(argv[3:], stub.StubConfig(version=version))
        unpinned[drafter.name] = Kernels.from_args(args)
        assert unpinned[drafter.name].attention == predicted_attention_backend(drafter)
    assert unpinned["eagle3"].label == "flashinfer" and unpinned["none"].label == "fa3"
    with pytest.raises(EngineError, match="different attention backends"):
        check_same_kernels(unpinned)
    with pytest.raises(EngineError, match="different attention backends"):
        SglangEngine(auto, clock=MonotonicClock(), log_dir=Path("/nonexistent"))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "pages",
    [(), ("--page-size", "16"), ("--page-size=16",), ("--page-", "16"), ("--page-size", "1")],
)
def test_the_predicted_backend_is_what_sglang_picks_at_a_page_size(
    stub: ModuleType, version: str, pages: tuple[str, ...]
) -> None:
    """The prediction "auto" is checked with reads --page-size from engine.sglang.extra_args
    (as argparse does: `=`, an abbreviation both releases take): above 1 it moves a topk-1
    EAGLE to flashinfer and leaves no speculation on fa3."""
    base = load_campaign(REPO / "sweeps" / "h100-llama8b.toml")
    sg = dataclasses.replace(base.engine.sglang, attention_backend="auto", extra_args=pages)
    campaign = dataclasses.replace(base, engine=dataclasses.replace(base.engine, sglang=sg))
    page_size = given_page_size(pages)
    assert page_size == (int(pages[-1].split("=")[-1]) if pages else None)
    for drafter in campaign.drafters:
        if version == "0.5.9" and drafter.algorithm == "DFLASH":
            continue
        for topk in (1, 4):
            if drafter.eagle_topk is not None:
                steps = drafter.num_steps or 3
                drafts = steps + 1 if topk == 1 else 8
                drafter = dataclasses.replace(
                    drafter, eagle_topk=topk, num_steps=steps, num_draft_tokens=drafts
                )
            argv = launch_argv(campaign, drafter, port=31000, version=version)
            args, _ = stub.parse_launch_argv(argv[3:], stub.StubConfig(version=version))
            expected = predicted_attention_backend(drafter, page_size)
            assert args["attention_backend"] == expected, (drafter, pages)


def test_attention_backend_key_is_validated(tmp_path: Path) -> None:
    assert _load(tmp_path, _campaign_text()).engine.sglang.attention_backend == "fa3"
    text = _campaign_text('attention_backend = "auto"')
    assert _load(tmp_path, text).engine.sglang.attention_backend == "auto"
    with pytest.raises(CampaignError, match=r"engine\.sglang\.attention_backend.*'fa9'"):
        _load(tmp_path, _campaign_text('attention_backend = "fa9"'))


def test_check_same_kernels_names_the_difference() -> None:
    fa3 = Kernels("fa3", "fa3", "fa3")
    split = Kernels("fa3", "fa3", "flashinfer")
    check_same_kernels({"none": fa3, "eagle": fa3}, "fa3")
    with pytest.raises(EngineError, match=r"'eagle'.*prefill=fa3,decode=flashinfer, not fa3"):
        check_same_kernels({"none": fa3, "eagle": split}, "fa3")
    with pytest.raises(EngineError, match="does not report its attention backend"):
        check_same_kernels({"none": Kernels(None, None, None)}, "fa3")
    with pytest.raises(EngineError, match="none: fa3, eagle: prefill=fa3,decode=flashinfer"):
        check_same_kernels({"none": fa3, "eagle": split})


@pytest.mark.slow
def test_a_server_that_swaps_the_pinned_backend_is_refused_and_stopped(tmp_path: Path) -> None:
    """fa3 cannot serve an fp8_e5m2 KV cache: SGLang quietly runs triton; dvfs must refuse,
    and stop that server at once (not at the next start or at exit)."""
    drafters = '\n[drafters.none]\nalgorithm = "none"\n'
    kv = 'extra_args = ["--kv-cache-dtype", "fp8_e5m2"]'
    path, marker = stub_campaign(tmp_path, drafters=drafters, batch="[1]", sglang_extra=kv)
    campaign = load_campaign(path)
    with SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs") as engine:
        with pytest.raises(EngineError, match="attention backend triton, not fa3"):
            engine.start(campaign.drafters[0])
        assert running(marker) == []  # stopped by the failed check itself


@pytest.mark.slow
def test_auto_backend_runs_when_drafters_agree_and_the_cube_records_it(tmp_path: Path) -> None:
    result, out, marker = one_clock_sweep(
        tmp_path,
        sglang_extra='attention_backend = "auto"',
    )
    assert result.exit_code == 0, result.output
    ds = dvfs.open_cube(str(out / "cube.nc"))
    assert list(ds["attention_backend"].values) == ["fa3", "fa3"]
    assert ds["attention_backend"].attrs["long_name"]
    servers = json.loads(ds.attrs["server_args"])
    assert servers["eagle3"]["args"]["attention_backend"] == "fa3"
    assert running(marker) == []


def test_auto_backend_that_resolves_differently_is_refused_before_any_server(
    tmp_path: Path,
) -> None:
    """--page-size 16 moves topk-1 EAGLE to flashinfer while no speculation stays on fa3: read
    from extra_args, the prediction refuses the campaign before any server starts (rather
    than failing the second drafter's cells after the first drafter was measured)."""
    result, out, marker = one_clock_sweep(
        tmp_path,
        sglang_extra='attention_backend = "auto"\nextra_args = ["--page-size", "16"]',
    )
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "would run different attention backends" in said
    assert "none: fa3" in said and "eagle3: flashinfer" in said
    assert not (out / "journal.jsonl").exists()
    assert running(marker) == []


@pytest.mark.slow
def test_auto_backend_that_resolves_differently_fails_the_odd_drafter(tmp_path: Path) -> None:
    """A difference the load-time prediction does not see (SGLang 0.5.9 reads "--pa" as
    --page-size; the prediction reads only what both releases take) is caught when the
    second server starts: its cells fail, the first drafter's were measured."""
    _, out, marker = one_clock_sweep(
        tmp_path,
        version="0.5.9",
        sglang_extra='attention_backend = "auto"\nextra_args = ["--pa", "16"]',
    )
    cells = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    by_drafter = {c["cell"]["drafter"]: c for c in cells if c["type"] == "cell"}
    # Whichever drafter started second is refused; the first one was measured.
    assert sorted(c["status"] for c in by_drafter.values()) == ["failed", "ok"]
    [failed] = [c for c in by_drafter.values() if c["status"] == "failed"]
    assert "different attention backends" in failed["error"]
    assert "none: fa3" in failed["error"] and "eagle3: flashinfer" in failed["error"]
    assert running(marker) == []


# -- 2. the server sees the metered GPU only ----------------------------------------------------


@pytest.mark.slow
def test_the_server_is_pinned_to_the_metered_gpu_by_uuid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nvml_support import load_fake

    from dvfs.backends import open_backends

    monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / "fake-nvml.json"))
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm,h100-sxm,h100-sxm")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = load_fake()
    nvml.fake_reset_state()
    path, marker = stub_campaign(
        tmp_path,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs='sm_clock = "stock"',
        gpu='backend = "nvml"\ndevices = [1]',
    )
    campaign = load_campaign(path)
    with open_backends(campaign, out_dir=tmp_path / "out", nvml=nvml) as backends:
        [gpu] = backends.gpus
        assert gpu.identity.index == 1 and gpu.identity.uuid.startswith("GPU-")
        info = backends.engine.start(campaign.drafters[0])
        log_text = Path(str(info.log_path)).read_text()
        backends.engine.stop()
    assert f"CUDA_VISIBLE_DEVICES={gpu.identity.uuid} " in log_text
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in log_text
    assert running(marker) == []


def test_server_env_refuses_a_contradicting_cuda_visible_devices(tmp_path: Path) -> None:
    campaign = _load(tmp_path, _campaign_text('env = { CUDA_VISIBLE_DEVICES = "GPU-aaa" }'))
    assert server_env(campaign, ["GPU-aaa"])["CUDA_VISIBLE_DEVICES"] == "GPU-aaa"
    with pytest.raises(EngineError, match=r"engine\.sglang\.env\.CUDA_VISIBLE_DEVICES"):
        server_env(campaign, ["GPU-bbb"])
    plain = _load(tmp_path, _campaign_text())
    assert server_env(plain, ["GPU-b", "GPU-c"])["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-c"


@pytest.mark.parametrize(
    ("env", "devices"),
    [('"0"', "[0]"), ('"1,0"', "[0, 1]"), ('"GPU-bbb"', '["GPU-aaa"]')],
)
def test_campaign_env_contradicting_gpu_devices_is_refused(
    tmp_path: Path, env: str, devices: str
) -> None:
    text = _campaign_text(f"env = {{ CUDA_VISIBLE_DEVICES = {env} }}").replace(
        'backend = "twin"\nprofile', f'backend = "twin"\ndevices = {devices}\nprofile', 1
    )
    text = text.replace("[engine]", f"[engine]\ntp_size = {devices.count(',') + 1}", 1)
    with pytest.raises(CampaignError, match=r"engine\.sglang\.env.*CUDA_VISIBLE_DEVICES"):
        _load(tmp_path, text)


# -- 4. managed flags cannot come back through extra_args ----------------------------------------


@pytest.mark.parametrize(
    ("engine_args", "flag", "use"),
    [
        ('["--tp-size", "2"]', "--tp-size", "engine.tp_size"),
        ('["--tp", "2"]', "--tp-size", "engine.tp_size"),
        ('["--tp-size=2"]', "--tp-size", "engine.tp_size"),
        ('["--tensor-parallel-size", "2"]', "--tensor-parallel-size", "engine.tp_size"),
        ('["--model", "other"]', "--model", "engine.model"),
        ('["--model-path=other"]', "--model-path", "engine.model"),
        ('["--port", "1234"]', "--port", "engine.sglang.url"),
        ('["--host", "0.0.0.0"]', "--host", "engine.sglang.host"),
        ('["--attention-backend", "triton"]', "--attention-backend", "attention_backend"),
        ('["--decode-attention-backend=triton"]', "--decode-attention-backend", "attention_b"),
        ('["--speculative-algorithm", "EAGLE"]', "--speculative-algorithm", ".algorithm"),
        ('["--speculative-eagle-topk", "4"]', "--speculative-eagle-topk", ".eagle_topk"),
        ('["--max-running-requests", "1"]', "--max-running-requests", "workload.batch"),
        ('["--base-gpu-id", "1"]', "--base-gpu-id", "gpu.devices"),
    ],
)
def test_engine_extra_args_cannot_override_managed_flags(
    tmp_path: Path, engine_args: str, flag: str, use: str
) -> None:
    with pytest.raises(CampaignError) as err:
        _load(tmp_path, _campaign_text(f"extra_args = {engine_args}"))
    message = str(err.value)
    assert "engine.sglang.extra_args" in message and f"sets {flag}" in message
    assert use in message.split("use ", 1)[1]


@pytest.mark.parametrize(
    ("drafter_args", "flag", "use"),
    [
        ('["--speculative-num-steps", "3"]', "--speculative-num-steps", "drafters.e.num_steps"),
        ('["--speculative-eagle-topk=2"]', "--speculative-eagle-topk", "drafters.e.eagle_topk"),
        ('["--speculative-draft-model", "x"]', "--speculative-draft-model", "drafters.e.draft_"),
        ('["--speculative-num-draft", "9"]', "--speculative-num-draft-tokens", ".num_draft_tok"),
        ('["--tp", "4"]', "--tp-size", "engine.tp_size"),
    ],
)
def test_drafter_extra_args_cannot_override_managed_flags(
    tmp_path: Path, drafter_args: str, flag: str, use: str
) -> None:
    drafters = f"""
[drafters.e]
algorithm = "EAGLE3"
draft_model = "d"
extra_args = {drafter_args}
"""
    with pytest.raises(CampaignError) as err:
        _load(tmp_path, _campaign_text(drafters=drafters))
    message = str(err.value)
    assert "drafters.e.extra_args" in message and f"sets {flag}" in message
    assert use in message.split("use ", 1)[1]


@pytest.mark.parametrize(
    ("where", "token"),
    [("engine", "--speculative-adaptive"), ("drafter", "--speculative-adaptive"),
     ("drafter", "--speculative-adaptive=true")],
)  # fmt: skip
def test_adaptive_speculation_is_refused_in_extra_args(
    tmp_path: Path, where: str, token: str
) -> None:
    """SGLang 0.5.23's --speculative-adaptive changes an EAGLE drafter's steps at run time
    (adaptive_spec_params.py, eagle_worker_v2.py apply_runtime_state), within a cell and
    differently at each clock: refused in one line wherever extra_args could pass it on."""
    engine_extra = f'extra_args = ["{token}"]' if where == "engine" else ""
    extra = f'extra_args = ["{token}"]' if where == "drafter" else ""
    drafters = f'\n[drafters.e]\nalgorithm = "EAGLE3"\ndraft_model = "d"\n{extra}\n'
    with pytest.raises(CampaignError) as err:
        _load(tmp_path, _campaign_text(engine_extra, drafters=drafters))
    message = str(err.value)
    key = "engine.sglang.extra_args" if where == "engine" else "drafters.e.extra_args"
    assert f"c.toml: {key}: sets --speculative-adaptive:" in message, message
    assert "within a cell and between clocks" in message and "\n" not in message
    # its config file alone changes nothing (SGLang reads it with the flag only)
    drafters = '\n[drafters.e]\nalgorithm = "EAGLE3"\ndraft_model = "d"\n'
    drafters += 'extra_args = ["--speculative-adaptive-config", "a.json"]\n'
    _load(tmp_path, _campaign_text(drafters=drafters))


def test_adaptive_speculation_has_no_other_spelling_argparse_reads() -> None:
    """Against 0.5.23's option table: every abbreviation of --speculative-adaptive is also one
    of --speculative-adaptive-config (argparse refuses it as ambiguous), so the refusal of the
    whole flag catches every spelling a server would take; 0.5.9 has no such option."""
    from dvfs.campaign.sglang_flags import ADAPTIVE_FLAG, adaptive_flag

    flags = [f for o in json.loads((TABLES / "0.5.23.json").read_text())["options"]
             for f in o["flags"]]  # fmt: skip
    assert ADAPTIVE_FLAG in flags
    for cut in range(3, len(ADAPTIVE_FLAG)):
        prefix = ADAPTIVE_FLAG[:cut]
        assert prefix in flags or len([f for f in flags if f.startswith(prefix)]) > 1, prefix
    assert adaptive_flag(ADAPTIVE_FLAG) and not adaptive_flag("--speculative-adaptive-config")
    old = [f for o in json.loads((TABLES / "0.5.9.json").read_text())["options"]
           for f in o["flags"]]  # fmt: skip
    assert not [f for f in old if "adaptive" in f and f.startswith("--speculative")]


def test_unmanaged_extra_args_pass() -> None:
    for token in ("--mem-fraction-static", "--kv-cache-dtype", "--page-size", "--no-such-flag"):
        assert managed_flag(token) is None
    assert managed_flag("--speculative-ngram-max-bfs-breadth") is None
    assert managed_flag("--speculative-draft-attention-backend") is None


@pytest.mark.parametrize("version", VERSIONS)
def test_managed_flags_match_what_sglangs_parser_would_read(version: str) -> None:
    """Against the real option table: every spelling argparse resolves to a managed option
    (aliases and unambiguous abbreviations) is caught, and no other option is."""
    table = json.loads((TABLES / f"{version}.json").read_text())
    managed = {flag for flags, _ in MANAGED_FLAGS for flag in flags}
    dest_of: dict[str, str] = {}
    for option in table["options"]:
        for flag in option["flags"]:
            if flag.startswith("--"):
                dest_of[flag] = option["flags"][0]
    managed_dests = {dest_of[f] for f in managed if f in dest_of}
    assert managed_dests, "the table lost every managed flag"
    for flag in dest_of:
        caught = managed_flag(flag) is not None
        assert caught == (dest_of[flag] in managed_dests), flag
    for flag, dest in dest_of.items():
        if dest not in managed_dests:
            continue
        for cut in range(3, len(flag)):
            prefix = flag[:cut]
            matches = {dest_of[f] for f in dest_of if f.startswith(prefix)}
            if prefix not in dest_of and matches == {dest}:  # argparse takes this abbreviation
                assert managed_flag(prefix) is not None, prefix
                assert managed_flag(prefix + "=1") is not None, prefix


def test_ngram_takes_no_draft_model(tmp_path: Path) -> None:
    drafters = '\n[drafters.ng]\nalgorithm = "NGRAM"\ndraft_model = "some/model"\n'
    with pytest.raises(CampaignError, match=r"drafters\.ng\.draft_model.*NGRAM"):
        _load(tmp_path, _campaign_text(drafters=drafters))


# -- 5. process and request robustness ----------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_launcher_makes_the_server_die_with_its_parent(tmp_path: Path) -> None:
    """A parent that is SIGKILLed takes the launched command with it; no preexec_fn involved."""
    marker = f"pdeathsig-{time.monotonic_ns()}"
    pid_file = tmp_path / "child.pid"
    child = [sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"]
    parent_code = (
        "import subprocess, time\n"
        "from dvfs.engines.sglang import dying_with_parent\n"
        f"p = subprocess.Popen(dying_with_parent({child!r}), start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 60  # a guard against hanging, not a latency bound
        while not (pid_file.exists() and pid_file.read_text()) or not running(marker):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        parent.kill()
        parent.wait(timeout=30)
        while running(marker):
            assert time.monotonic() < deadline, "the child outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
        for line in running(marker):
            subprocess.run(["kill", "-9", line.split()[0]], check=False)


def test_the_launcher_refuses_to_start_an_orphan(tmp_path: Path) -> None:
    """If the parent named on the command line is not its parent any more, nothing starts."""
    launcher = Path(dvfs.__file__).parent / "engines" / "_pdeathsig.py"
    flag = tmp_path / "ran"
    code = f"open({str(flag)!r}, 'w').close()"
    result = subprocess.run(
        [sys.executable, str(launcher), "1", sys.executable, "-c", code], timeout=60, check=False
    )
    if sys.platform.startswith("linux"):
        assert result.returncode == 1 and not flag.exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "closed-loop"])
def test_a_slow_request_fails_at_its_deadline_as_a_cell_error(tmp_path: Path, mode: str) -> None:
    """request_timeout_s bounds a whole streamed request, not just the wait for a connection:
    chunks arrive every 0.2 s (never a stall), but 32 tokens take ~6 s > 0.5 s."""
    workload = 'mode = "closed-loop"\npool_size = 2\nignore_eos = true' if mode != "fixed" else ""
    _, out, marker = one_clock_sweep(
        tmp_path,
        stub={"tpot_s": 0.2, "natural_stop": False},
        drafters=ONE_DRAFTER,
        request_timeout_s=0.5,
        stall_timeout_s=10.0,
        retries=0,
        workload_extra=workload,
    )
    cells = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    [cell] = [c for c in cells if c["type"] == "cell"]
    assert cell["status"] == "failed"
    assert "missed its deadline" in cell["error"] and "request_timeout_s = 0.5 s" in cell["error"]
    assert running(marker) == []


def test_launcher_argv_keeps_the_server_argv_intact() -> None:
    argv = ["/usr/bin/env", "true"]
    wrapped = dying_with_parent(argv)
    assert wrapped[-2:] == argv
    if sys.platform.startswith("linux"):
        assert wrapped[0] == sys.executable and wrapped[2].endswith("_pdeathsig.py")
        assert wrapped[3] == str(os.getpid())


def test_argparse_reads_managed_abbreviations_like_the_stub(stub: ModuleType) -> None:
    """Sanity for the abbreviation rule: SGLang's parser does take `--tp` for --tp-size."""
    for version in VERSIONS:
        assert _resolve(stub, version, "--tp", "2")["tp_size"] == 2
        with pytest.raises(SystemExit):
            parser = stub.build_parser(version)
            assert isinstance(parser, argparse.ArgumentParser)
            parser.parse_args(["--model-path", "m", "--speculative-num", "3"])  # ambiguous


def test_parse_campaign_keeps_the_backend_in_the_campaign() -> None:
    data: dict[str, Any] = {
        "gpu": {"backend": "twin", "profile": "h100-sxm"},
        "engine": {"backend": "sglang", "model": "m", "sglang": {"attention_backend": "triton"}},
        "workload": {"batch": [1], "corpora": ["code"]},
    }
    campaign = parse_campaign(data)
    assert campaign.engine.sglang.attention_backend == "triton"
    assert "triton" in json.dumps(campaign.semantic_dict())


def test_auto_kernels_that_would_differ_are_an_invalid_campaign_everywhere(
    tmp_path: Path,
) -> None:
    """The attention backend left to SGLang and an EAGLE tree (topk 4): SGLang would give the
    drafters other kernels, so the campaign is invalid: the sweep refuses it before any server
    starts and leaves no journal, its dry run says so, and the preflight fails, all exit 2."""
    drafters = (
        '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.eagle3]\nalgorithm = "EAGLE3"\n'
        'draft_model = "d/e"\nnum_steps = 3\neagle_topk = 4\nnum_draft_tokens = 8\n'
    )
    path, marker = stub_campaign(
        tmp_path, drafters=drafters, batch="[1]", sglang_extra='attention_backend = "auto"'
    )
    out = tmp_path / "out"
    for args in (
        ["sweep", str(path), "--out", str(out), "--no-progress"],
        ["sweep", str(path), "--out", str(out), "--dry-run", "--no-estimate"],
        ["doctor", str(path), "--out", str(out)],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
        assert "would run different attention backends" in " ".join(result.output.split())
    assert not (out / "journal.jsonl").exists()
    assert running(marker) == []


def test_a_flag_this_release_does_not_have_is_refused_where_no_drafter_speculates(
    tmp_path: Path,
) -> None:
    """The same flag in engine.sglang.extra_args of a campaign whose one drafter does not
    speculate: its server fails at once (SGLang's argparse), every cell with it; so the sweep
    refuses it before the journal (exit 2), and `dvfs doctor`, which said ok, fails its arms
    check in the same line, exit 2."""
    flag = "--speculative-ngram-branch-length"
    result, out, marker = one_clock_sweep(
        tmp_path,
        version="0.5.23",
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        sglang_extra=f'extra_args = ["{flag}", "8"]',
    )
    said = f"engine.sglang.extra_args: {flag} is not an option of this SGLang's launch_server"
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split())
    assert not (out / "journal.jsonl").exists() and running(marker) == []
    checked = CliRunner().invoke(
        cli, ["doctor", str(tmp_path / "stub-campaign.toml"), "--out", str(out)]
    )
    assert checked.exit_code == 2, checked.output
    [failed] = [line for line in checked.output.splitlines() if line.startswith("FAIL")]
    assert failed.startswith("FAIL arms:") and said in " ".join(checked.output.split())


@pytest.mark.parametrize(("version", "code"), [("0.5.23", 2), ("0.5.9", 0)])
def test_a_flag_this_release_does_not_have_is_refused_before_any_server(
    tmp_path: Path, version: str, code: int
) -> None:
    """0.5.23 removed --speculative-ngram-branch-length: read against the release's own
    `launch_server --help`, a drafter passing it is refused before the journal is made, not
    when its server fails to start (perhaps hours in); 0.5.9, which has it, runs the sweep."""
    from sglang_support import EAGLE3_DRAFTER

    # An n-gram flag on the EAGLE-3 drafter: SGLang 0.5.9 parses it (and ignores it there).
    drafters = (
        '\n[drafters.none]\nalgorithm = "none"\n'
        + EAGLE3_DRAFTER
        + 'extra_args = ["--speculative-ngram-branch-length", "8"]\n'
    )
    result, out, marker = one_clock_sweep(
        tmp_path,
        version=version,
        drafters=drafters,
    )
    assert result.exit_code == code, result.output
    if code:
        said = " ".join(result.output.split())
        flag = "--speculative-ngram-branch-length"
        assert f"drafters.eagle3.extra_args: {flag} is not an option" in said, said
        assert "Traceback" not in result.output and not (out / "journal.jsonl").exists()
    assert running(marker) == []


@pytest.mark.parametrize(
    ("version", "pinned", "code"),
    [("0.5.9", "", 2), ("0.5.23", 'version = "0.5.9"', 2), ("0.5.23", "", 0)],
)
def test_an_algorithm_this_release_does_not_have_is_refused_before_any_server(
    tmp_path: Path, version: str, pinned: str, code: int
) -> None:
    """A DFLASH drafter on SGLang 0.5.9 (whose --help lists --speculative-algorithm's
    choices), or on a campaign pinning engine.sglang.version 0.5.9: its server would exit at
    SGLang's argparse once the plain arm was measured, its cells failing at every rerun; the
    sweep refuses it before the journal is made (exit 2). 0.5.23, which has it, runs it."""
    drafters = (
        '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.dflash]\nalgorithm = "DFLASH"\n'
        'draft_model = "d/f"\nblock_size = 8\n'
    )
    result, out, marker = one_clock_sweep(
        tmp_path, version=version, drafters=drafters, sglang_extra=pinned
    )
    dry = CliRunner().invoke(
        cli, ["sweep", str(tmp_path / "stub-campaign.toml"), "--dry-run", "--no-estimate"]
    )
    for run in (result, dry):
        assert run.exit_code == code, run.output
        if code:
            said = " ".join(run.output.split())
            assert "drafters.dflash.algorithm:" in said and "0.5.23 or newer" in said, said
            assert "Traceback" not in run.output
    assert not code or not (out / "journal.jsonl").exists()
    assert running(marker) == []


def test_an_attached_servers_algorithm_is_not_judged_by_this_machines_sglang(
    tmp_path: Path,
) -> None:
    """A campaign attached to a running server (engine.sglang.url) on a machine whose own
    SGLang is 0.5.9: the DFLASH drafter is the remote server's business (the sweep checks it
    once the server answers), so the dry run shows the plan instead of refusing the campaign."""
    drafters = '\n[drafters.dflash]\nalgorithm = "DFLASH"\ndraft_model = "d/f"\nblock_size = 8\n'
    path, _ = stub_campaign(
        tmp_path,
        version="0.5.9",
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        drafters=drafters,
        sglang_extra='url = "http://127.0.0.1:9"',
    )
    dry = CliRunner().invoke(cli, ["sweep", str(path), "--dry-run", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    assert "1 to run" in dry.output and "Error" not in dry.output


def test_an_attached_campaigns_estimates_charge_no_server_start(tmp_path: Path) -> None:
    """engine.sglang.url: the server runs already, so neither the twin's estimate nor the
    closed-form one charges a server start (the same campaign launching its server does);
    everything else the two spend is the same."""
    dry: dict[str, dict[str, Any]] = {}
    for how, extra in (("attached", 'url = "http://127.0.0.1:9"'), ("launched", "")):
        (tmp_path / how).mkdir()
        path, _ = stub_campaign(
            tmp_path / how,
            batch="[1]",
            knobs="sm_clock = [1980]\nsettle_s = 0.0",
            drafters='\n[drafters.none]\nalgorithm = "none"\n',
            sglang_extra=extra,
        )
        path.write_text(
            path.read_text().replace("[engine]\n", '[engine]\ntwin_model = "llama-3.1-8b"\n')
        )
        for estimate in ("twin", "closed"):
            options = ["--no-estimate"] if estimate == "closed" else []
            result = CliRunner().invoke(cli, ["sweep", str(path), "--dry-run", "--json", *options])
            assert result.exit_code == 0, result.output
            dry[f"{how} {estimate}"] = json.loads(result.output)
    from dvfs.engines.twin import STARTUP_S
    from dvfs.measure.plan import SERVER_START_S

    launched, attached = dry["launched twin"], dry["attached twin"]
    assert launched["twin_gpu_s"] - attached["twin_gpu_s"] == pytest.approx(STARTUP_S)
    assert attached["estimate"]["naive_gpu_hours"] < launched["estimate"]["naive_gpu_hours"]
    closed = {
        how: dry[f"{how} closed"]["estimated_hours_on_hardware"] for how in ("attached", "launched")
    }
    assert closed["launched"] - closed["attached"] == pytest.approx(SERVER_START_S / 3600, abs=0.01)


@pytest.mark.parametrize("pinned", [False, True])
def test_an_attached_campaigns_dry_run_launches_nothing_and_asks_no_local_sglang(
    tmp_path: Path, pinned: bool
) -> None:
    """engine.sglang.url: the sweep starts no server and runs no `launch_server --help` here,
    so its dry run shows the server it attaches to, no launch command, and neither runs this
    machine's server command nor judges the drafter by the SGLang version pinned for it (0.5.9
    has no DFLASH; the remote server is checked once it answers)."""
    probed = tmp_path / "probed"
    drafters = '\n[drafters.dflash]\nalgorithm = "DFLASH"\ndraft_model = "d/f"\nblock_size = 8\n'
    path, _ = stub_campaign(
        tmp_path,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        drafters=drafters,
        sglang_extra='url = "http://alice:pw-1@127.0.0.1:9"'
        + ('\nversion = "0.5.9"' if pinned else ""),
    )
    text = path.read_text().splitlines()
    [at] = [i for i, line in enumerate(text) if line.startswith("server_command")]
    # A command that leaves a mark when run (its --help probe included).
    text[at] = f"server_command = {json.dumps(['sh', '-c', f'touch {probed}', 'sh'])}"
    path.write_text("\n".join(text) + "\n")
    runner = CliRunner()
    dry = runner.invoke(cli, ["sweep", str(path), "--dry-run", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    said = " ".join(dry.output.split())
    assert "dflash: attaches to the SGLang server at http://(not recorded)@127.0.0.1:9" in said
    assert "1 attach(es) to the running server" in said and "server start(s)" not in said
    assert "--model-path" not in said and "launch flags from" not in said
    assert "pw-1" not in dry.output
    assert not probed.exists()
    as_json = runner.invoke(cli, ["sweep", str(path), "--dry-run", "--no-estimate", "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output)["servers"] == [
        {"drafter": "dflash", "attached_to": "http://(not recorded)@127.0.0.1:9"}
    ]
