"""SGLang server flags a campaign may name or must leave alone: configuration-level facts.

Kept apart from `dvfs.engines.sglang_args` (which builds the launch argv) because the campaign
loader checks these flags at load time, and configuration must not import an engine: the
engine depends on this table, not the reverse. A leaf module: it imports nothing from dvfs.
"""

from __future__ import annotations

#: Values of `--attention-backend` in SGLang 0.5.9 and 0.5.23 (their option tables' choices).
ATTENTION_BACKENDS = (
    "aiter", "ascend", "compressed", "cutedsl_mla", "cutlass_mla", "dsa", "dsv4",
    "dual_chunk_flash_attn", "fa3", "fa4", "flashinfer", "flashmla", "flex_attention",
    "hpc_ops", "intel_amx", "intel_xpu", "llada2_cfg_flashinfer", "minicpm_flashattn",
    "minicpm_flashinfer", "nsa", "qsa", "tokenspeed_mla", "torch_native", "triton",
    "trtllm_mha", "trtllm_mla", "wave",
)  # fmt: skip
#: engine.sglang.attention_backend's default: SGLang's own pick on Hopper for every drafter but
#: EAGLE with topk > 1, and a kernel that serves every drafter (EAGLE trees included).
DEFAULT_ATTENTION_BACKEND = "fa3"
#: Flags dvfs sets in every launch argv (aliases included), and the campaign key that sets each.
#: `{drafter}` is filled with the drafter's table.
MANAGED_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--model-path", "--model"), "engine.model"),
    (("--host",), "engine.sglang.host"),
    (("--port",), "engine.sglang.url to serve on a port of your choosing (dvfs picks a free one)"),
    (("--tp-size", "--tensor-parallel-size"), "engine.tp_size"),
    (("--base-gpu-id",), "gpu.devices (dvfs pins the server to them)"),
    (("--attention-backend",), "engine.sglang.attention_backend"),
    (("--prefill-attention-backend",), "engine.sglang.attention_backend"),
    (("--decode-attention-backend",), "engine.sglang.attention_backend"),
    (
        ("--max-running-requests",),
        "workload.batch (dvfs sets it to the largest batch, rounded up to a whole turn for each "
        "attention DP rank and pipeline micro-batch)",
    ),
    (("--cuda-graph-max-bs",), "workload.batch (dvfs sets it to the largest batch)"),
    (("--cuda-graph-max-bs-decode",), "workload.batch (dvfs sets it to the largest batch)"),
    (("--cuda-graph-bs",), "workload.batch (dvfs captures a CUDA graph for each batch)"),
    (("--cuda-graph-bs-decode",), "workload.batch (dvfs captures a CUDA graph for each batch)"),
    # 0.5.23: a JSON of graph settings whose sizes win over the flags above.
    (("--cuda-graph-config",), "workload.batch (dvfs captures a CUDA graph for each batch)"),
    (("--speculative-algorithm",), "{drafter}.algorithm"),
    (("--speculative-draft-model-path", "--speculative-draft-model"), "{drafter}.draft_model"),
    (("--speculative-num-steps",), "{drafter}.num_steps"),
    (("--speculative-eagle-topk",), "{drafter}.eagle_topk"),
    (("--speculative-num-draft-tokens",), "{drafter}.num_draft_tokens"),
    (("--speculative-dflash-block-size",), "{drafter}.block_size"),
)


#: What a drafter's own extra_args may carry: flags that configure only the drafter, so that its
#: server differs from the other arms' in the drafter alone. From SGLang 0.5.9's and 0.5.23's
#: option tables: every `--speculative-*` option (0.5.23 adds `--no-speculative-*` negations),
#: and these, which act only when speculating. Any other flag belongs in
#: engine.sglang.extra_args, which every drafter's server shares.
DRAFTER_FLAG_PREFIXES = ("--speculative-", "--no-speculative-", "--decoupled-spec-")
DRAFTER_FLAGS = (
    "--enable-multi-layer-eagle",
    "--enable-draft-weights-cpu-backup",
    "--decrypted-draft-config-file",
    "--enable-linear-replayssm-spec",
    "--spec-trace-dir",
)


#: SGLang 0.5.23's adaptive speculation (speculative/adaptive_spec_params.py, applied by
#: eagle_worker_v2.py `apply_runtime_state`): an EAGLE/EAGLE3 drafter with topk 1 (other
#: algorithms and setups fall back to static steps) changes its steps at run time from its
#: accept rate, so within a cell and differently at each clock (timing drives it). Every
#: shorter spelling is also a prefix of --speculative-adaptive-config, which argparse refuses.
ADAPTIVE_FLAG = "--speculative-adaptive"
#: Why a server with adaptive speculation is refused, in the words of both refusals (a
#: campaign's extra_args, an attached server's /server_info).
ADAPTIVE_WHY = (
    "SGLang then changes an EAGLE drafter's speculative steps at run time from its accept "
    "rate, so they would vary within a cell and between clocks, and a cell would measure no "
    "one drafter"
)


def adaptive_flag(token: str) -> bool:
    """Whether argparse would read `token` as --speculative-adaptive (`ADAPTIVE_FLAG`)."""
    return token.split("=", 1)[0] == ADAPTIVE_FLAG


def non_drafter_flag(token: str) -> str | None:
    """The flag `token` names when it is a flag but not a drafter's own (`DRAFTER_FLAGS`),
    else None (a drafter flag, or a value such as "16" or "-1"). Abbreviations count only
    under the `--speculative-` prefixes: any other must be spelt in full."""
    if len(token) < 2 or token[0] != "-" or not (token[1].isalpha() or token[1] == "-"):
        return None
    name = token.split("=", 1)[0]
    if name.startswith(DRAFTER_FLAG_PREFIXES) or name in DRAFTER_FLAGS:
        return None
    return name


def managed_flag(token: str, drafter: str = "drafters.<name>") -> tuple[str, str] | None:
    """(flag, campaign key) when argparse would read `token` as a flag dvfs sets itself.

    Covers aliases, `--flag=value`, and abbreviations (SGLang's parser takes any unambiguous
    prefix of a long flag, e.g. `--tp` for `--tp-size`). A prefix shared with a flag dvfs does not
    manage is ambiguous, which SGLang refuses anyway.
    """
    if not token.startswith("--") or len(token) <= 2:
        return None
    name = token.split("=", 1)[0]
    for flags, key in MANAGED_FLAGS:
        for flag in flags:
            if flag == name:
                return flag, key.format(drafter=drafter)
    for flags, key in MANAGED_FLAGS:
        for flag in flags:
            if flag.startswith(name):
                return flag, key.format(drafter=drafter)
    return None
