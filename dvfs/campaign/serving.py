"""The [engine] and [drafters.*] tables: which server runs, and how it speculates.

Checks here follow SGLang's flag rules (`dvfs.campaign.sglang_flags`) and, for the twin, ask the
twin's draft planner (`dvfs.twin.drafting`) whether it can model a drafter, so a campaign is
refused at load rather than mid-sweep.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from dvfs.campaign.model import (
    EAGLE_TRIPLE,
    NAME_RE,
    NEEDS_DRAFT_MODEL,
    SPECULATIVE_ALGORITHMS,
    Campaign,
    DrafterSpec,
    EngineConfig,
    GpuConfig,
    SglangConfig,
)
from dvfs.campaign.sglang_flags import (
    ADAPTIVE_FLAG,
    ADAPTIVE_WHY,
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    adaptive_flag,
    managed_flag,
    non_drafter_flag,
)
from dvfs.campaign.table import Table, argv_list
from dvfs.errors import CampaignError
from dvfs.gpu.base import names_gpu


def server_command(campaign: Campaign) -> list[str]:
    """What starts a server: the campaign's override, or this Python's sglang.launch_server."""
    command = list(campaign.engine.sglang.server_command)
    return command or [sys.executable, "-m", "sglang.launch_server"]


def parse_engine(table: Table, gpu: GpuConfig) -> EngineConfig:
    """The [engine] table (with [engine.sglang]), checked against the GPUs it runs on."""
    backend = table.string("backend", "twin", choices=("twin", "sglang"))
    model = table.string("model")
    if model is None:
        raise table.missing("model")
    tp_size = table.integer("tp_size", gpu.server_size, minimum=1)
    if tp_size != gpu.server_size:
        where = "each group of gpu.devices" if gpu.groups else "gpu.devices"
        raise table.fail(
            "tp_size", f"{tp_size} does not match the {gpu.server_size} GPU(s) in {where}"
        )
    twin_model = table.string("twin_model")
    sg = table.sub("sglang")
    url = sg.string("url")
    if url is not None and not re.match(r"^https?://", url):
        raise sg.fail("url", f"expected an http:// or https:// URL, got {url!r}")
    env = sg.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise sg.fail("env", "expected a table of string environment variables")
    sglang = SglangConfig(
        url=url,
        server_command=argv_list(sg, "server_command"),
        extra_args=argv_list(sg, "extra_args"),
        version=sg.string("version"),
        host=sg.string("host", "127.0.0.1"),
        startup_timeout_s=sg.seconds("startup_timeout_s", 900.0, strictly_positive=True),
        request_timeout_s=sg.seconds("request_timeout_s", 120.0, strictly_positive=True),
        stall_timeout_s=sg.seconds("stall_timeout_s", 60.0, strictly_positive=True),
        env=tuple(sorted(env.items())),
        attention_backend=_attention_backend(sg),
    )
    refuse_managed_flags(sg, "extra_args", sglang.extra_args, "drafters.<name>")
    refuse_adaptive(sg, sglang.extra_args)
    _refuse_config_file(sg, sglang.extra_args)
    _refuse_server_flags(sg, sglang.server_command)
    _check_visible_devices(sg, env, gpu)
    sg.finish()
    table.finish()
    if backend == "twin":
        from dvfs.twin.profiles import model_profile

        try:
            model_profile(twin_model or model)
        except CampaignError as exc:
            raise table.fail("twin_model" if twin_model else "model", str(exc)) from exc
    return EngineConfig(backend, model, tp_size, twin_model, sglang)


def _attention_backend(sg: Table) -> str:
    value: str = sg.string("attention_backend", DEFAULT_ATTENTION_BACKEND)
    if value != "auto" and value not in ATTENTION_BACKENDS:
        raise sg.fail(
            "attention_backend",
            f'{value!r} is not an SGLang attention backend; choose "auto" (SGLang picks, dvfs '
            f"checks every drafter gets the same) or one of {', '.join(ATTENTION_BACKENDS)}",
        )
    return value


def refuse_managed_flags(table: Table, key: str, args: tuple[str, ...], drafter: str) -> None:
    """Flags dvfs sets itself must not come back through extra_args (argparse keeps the last)."""
    for token in args:
        found = managed_flag(token, drafter)
        if found is not None:
            flag, use = found
            written = "" if token.split("=", 1)[0] == flag else f" (as {token!r})"
            raise table.fail(key, f"sets {flag}{written}, which dvfs sets itself; use {use}")


def refuse_adaptive(table: Table, args: tuple[str, ...]) -> None:
    """--speculative-adaptive (SGLang 0.5.23) makes the drafter's steps vary within a cell
    and between clocks: each cell must measure one fixed drafter configuration."""
    if any(adaptive_flag(token) for token in args):
        raise table.fail(
            "extra_args",
            f"sets {ADAPTIVE_FLAG}: {ADAPTIVE_WHY}; remove it, and measure each step count "
            "as a drafter of its own (num_steps)",
        )


#: The token of a server command that names SGLang's launcher: what follows it is
#: launch_server's own argv, where dvfs appends its flags.
LAUNCHER = "sglang.launch_server"


def _refuse_config_file(sg: Table, args: tuple[str, ...]) -> None:
    """SGLang's --config reads launch_server flags from a YAML file: they would escape the
    checks on extra_args (a flag dvfs sets, one SGLang applies to some drafters only) and the
    campaign hash (the file may change between runs while the campaign does not)."""
    for token in args:
        if token.split("=", 1)[0] == "--config":
            raise sg.fail(
                "extra_args",
                "sets --config, whose file's flags dvfs can neither check nor hold the same "
                "between runs; write them in engine.sglang.extra_args instead",
            )


def _refuse_server_flags(sg: Table, command: tuple[str, ...]) -> None:
    """SGLang flags after the launcher in server_command would reach every server unchecked:
    dvfs's own flags come after them and win unseen, and server_command may change between
    runs (it is outside the campaign hash), so a resume could serve its arms with other
    kernels or scheduling than the journal's first ones. They belong in extra_args."""
    if LAUNCHER not in command:
        return
    flags = command[command.index(LAUNCHER) + 1 :]
    if flags:
        raise sg.fail(
            "server_command",
            f"passes {' '.join(flags)} to {LAUNCHER}: server_command may change between runs "
            "without changing the campaign, so SGLang flags there could serve a resumed "
            "sweep's arms differently; end server_command at "
            f"{LAUNCHER} and put the flags in engine.sglang.extra_args",
        )


def refuse_engine_flags(table: Table, drafter: str, args: tuple[str, ...]) -> None:
    """A drafter's extra_args carry only its own speculative flags: any other flag (memory,
    dtype, quantization, CUDA graphs, chunked prefill...) would make its arm differ from the
    others in more than the drafter."""
    for token in args:
        flag = non_drafter_flag(token)
        if flag is not None:
            raise table.fail(
                "extra_args",
                f"sets {flag}, which is not a speculative flag: drafter {drafter!r} "
                "would then differ from the other arms in more than its drafter. A drafter's "
                "extra_args take only its own flags (--speculative-*, spelt in full); put "
                f"{flag} in engine.sglang.extra_args, which every drafter's server shares",
            )


def _check_visible_devices(sg: Table, env: dict[str, Any], gpu: GpuConfig) -> None:
    """dvfs pins the server to gpu.devices by UUID; an env naming other GPUs contradicts it."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return
    entries = [v.strip() for v in value.split(",") if v.strip()]
    if not all(e.upper().startswith(("GPU-", "MIG-")) for e in entries):
        raise sg.fail(
            "env",
            f"CUDA_VISIBLE_DEVICES = {value!r}: CUDA and NVML may number GPUs differently, and "
            "dvfs already pins the server to gpu.devices by UUID; remove CUDA_VISIBLE_DEVICES",
        )
    uuids = [d for d in gpu.devices if isinstance(d, str)]
    if len(uuids) == len(gpu.devices) and (
        len(entries) != len(uuids)
        or not all(names_gpu(e, u) for e, u in zip(entries, uuids, strict=True))
    ):
        raise sg.fail(
            "env",
            f"CUDA_VISIBLE_DEVICES = {value!r} contradicts gpu.devices {list(gpu.devices)}; "
            "remove it (dvfs pins the server to gpu.devices by UUID)",
        )


def parse_drafter(table: Table, name: str, engine: EngineConfig) -> DrafterSpec:
    """One [drafters.NAME] table, by SGLang's rules for its algorithm."""
    if not NAME_RE.match(name):
        raise CampaignError(
            f"{table.where}: drafter name {name!r} must start with a letter or digit and use only "
            "letters, digits, '_', '-' and '.'"
        )
    raw = table.string("algorithm", "none")
    algorithm = None if raw.lower() == "none" else raw.upper()
    if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
        raise table.fail(
            "algorithm",
            f"{raw!r} is not a speculative algorithm SGLang knows; choose none or one of "
            f"{', '.join(SPECULATIVE_ALGORITHMS)}",
        )
    draft_model = table.string("draft_model")
    steps = table.integer("num_steps", minimum=1)
    topk = table.integer("eagle_topk", minimum=1)
    draft_tokens = table.integer("num_draft_tokens", minimum=1)
    block = table.integer("block_size", minimum=2)
    extra = argv_list(table, "extra_args")
    table.finish()
    refuse_managed_flags(table, "extra_args", extra, table.path)
    refuse_engine_flags(table, name, extra)
    refuse_adaptive(table, extra)
    if algorithm == "NGRAM" and draft_model is not None:
        raise table.fail(
            "draft_model",
            "NGRAM drafts from the text seen so far and takes no draft model; remove draft_model",
        )
    if algorithm == "NGRAM" and (steps is not None or topk is not None):
        # dvfs passes NGRAM num_draft_tokens alone (and the twin models it alone): SGLang sets
        # its topk to --speculative-ngram-max-bfs-breadth whatever it is given, and 0.5.23
        # derives its steps from the draft tokens and that breadth.
        raise table.fail(
            "num_steps" if steps is not None else "eagle_topk",
            "is not an NGRAM setting (SGLang sets the tree's breadth from "
            "--speculative-ngram-max-bfs-breadth and its steps from that and num_draft_tokens); "
            "remove it, and give the breadth as --speculative-ngram-max-bfs-breadth in the "
            "drafter's extra_args",
        )
    if algorithm is None:
        given = [
            k
            for k, v in (
                ("draft_model", draft_model),
                ("num_steps", steps),
                ("eagle_topk", topk),
                ("num_draft_tokens", draft_tokens),
                ("block_size", block),
            )
            if v is not None
        ]
        if given:
            raise table.fail(
                given[0], "is set but algorithm is none; set an algorithm or remove it"
            )
        return DrafterSpec(name=name, extra_args=extra)
    if algorithm in NEEDS_DRAFT_MODEL and draft_model is None:
        raise table.fail(
            "draft_model", f"{algorithm} needs a draft model (a path or Hugging Face name)"
        )
    if algorithm == "DFLASH":
        if steps not in (None, 1) or topk not in (None, 1):
            raise table.fail(
                "num_steps" if steps not in (None, 1) else "eagle_topk",
                "DFLASH drafts one block per step: num_steps and eagle_topk are fixed at 1",
            )
        if block is not None and draft_tokens is not None and block != draft_tokens:
            raise table.fail("block_size", "block_size and num_draft_tokens are aliases; give one")
        size = block or draft_tokens
        return DrafterSpec(name, algorithm, draft_model, 1, 1, size, extra)
    if block is not None:
        raise table.fail("block_size", "only block drafters (DFLASH) take a block size")
    if algorithm != "NGRAM":
        # Every algorithm but NGRAM and DFLASH gets the three numbers on its command line
        # together or not at all (`dvfs.engines.sglang_args.speculative_args`): DSPARK and UNO
        # too, whose partial set would otherwise stop the sweep at their arm's first start.
        triple = {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": draft_tokens}
        given = [k for k, v in triple.items() if v is not None]
        if 0 < len(given) < 3:
            missing = [k for k in triple if k not in given]
            raise table.fail(
                missing[0],
                f"SGLang needs num_steps, eagle_topk and num_draft_tokens all set or none "
                f"(it asserts on a partial set); missing {', '.join(missing)}",
            )
    forced = steps + 1 if algorithm in EAGLE_TRIPLE and topk == 1 and steps else None
    if forced is not None and draft_tokens != forced:
        raise table.fail(
            "num_draft_tokens",
            f"with eagle_topk = 1 SGLang forces num_draft_tokens = num_steps + 1 = {forced}, "
            f"not {draft_tokens}",
        )
    if algorithm in EAGLE_TRIPLE and steps is not None and topk is not None:
        _check_tree_size(table, steps, topk, draft_tokens)
    if engine.backend == "twin" and algorithm in ("DSPARK", "UNO"):
        raise table.fail(
            "algorithm",
            f'the twin has no model of {algorithm}; use it with engine.backend = "sglang"',
        )
    spec = DrafterSpec(name, algorithm, draft_model, steps, topk, draft_tokens, extra)
    if engine.backend == "twin":
        _check_twin_drafter(table, spec, engine)
    return spec


def _check_tree_size(table: Table, steps: int, topk: int, draft_tokens: int) -> None:
    """An EAGLE-family tree verifies num_draft_tokens - 1 drafts picked from the candidates
    its steps drafted: eagle_topk at the first step, eagle_topk x eagle_topk at each later one
    (SGLang's `build_tree_kernel_efficient_preprocess`: `torch.topk(score_list,
    num_verify_tokens - 1)` over them, which fails with more). SGLang starts with more, and the
    drafter's arm would fail at its first decode."""
    most = topk + (steps - 1) * topk * topk + 1
    if draft_tokens > most:
        raise table.fail(
            "num_draft_tokens",
            f"{draft_tokens} is above {most}: SGLang's draft tree holds eagle_topk + "
            f"(num_steps - 1) x eagle_topk^2 = {most - 1} candidates ({steps} steps, top "
            f"{topk}), plus the verified token; give num_draft_tokens at most {most}, or more "
            "num_steps or eagle_topk",
        )


def _check_twin_drafter(table: Table, spec: DrafterSpec, engine: EngineConfig) -> None:
    """The twin must know the shape of a standalone draft model: refuse at load, not mid-sweep."""
    from dvfs.errors import EngineError
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.profiles import model_profile

    try:
        plan_drafter(spec, model_profile(engine.simulated_model))
    except EngineError as exc:
        raise table.fail("draft_model", str(exc)) from exc
