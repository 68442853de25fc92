"""The `launch_server` argv for a drafter, following SGLang's flag rules.

- The three EAGLE numbers go together or not at all (SGLang asserts on a partial set).
- `--max-running-requests` at least the largest batch: any speculative algorithm otherwise
  caps it at 48 without saying so.
- CUDA graphs captured up to the largest batch: `--cuda-graph-max-bs` up to 0.5.9;
  0.5.23 split it into `--cuda-graph-max-bs-decode` / `-prefill`, and the old flag is then an
  ambiguous prefix that argparse rejects. Which one is read from `launch_server --help`,
  else from the version.
- DFLASH (a block drafter) exists from 0.5.23; its block size is --speculative-num-draft-tokens.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence

from dvfs.campaign import Campaign, DrafterSpec
from dvfs.errors import EngineError

NEW_CUDA_GRAPH_FLAG = "--cuda-graph-max-bs-decode"
OLD_CUDA_GRAPH_FLAG = "--cuda-graph-max-bs"
#: Algorithms each SGLang release accepts (0.5.9's argparse choices; 0.5.23's registry).
ALGORITHMS_BY_VERSION = {
    (0, 5, 9): ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"),
    (0, 5, 23): ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO"),
}


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(p) for p in match.groups(default="0"))


def server_command(campaign: Campaign) -> list[str]:
    """What starts a server: the campaign's override, or this Python's sglang.launch_server."""
    command = list(campaign.engine.sglang.server_command)
    return command or [sys.executable, "-m", "sglang.launch_server"]


def server_env(campaign: Campaign) -> dict[str, str]:
    """The environment a server (and its --help probe) runs with: ours plus the campaign's."""
    import os

    return {**os.environ, **dict(campaign.engine.sglang.env)}


def probe_help(
    command: Sequence[str], timeout_s: float = 180.0, env: dict[str, str] | None = None
) -> str | None:
    """`launch_server --help` text, or None when it cannot be run here."""
    try:
        result = subprocess.run(
            [*command, "--help"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = result.stdout + result.stderr
    return text if "--model-path" in text else None


def cuda_graph_flag(help_text: str | None, version: tuple[int, ...] | None) -> str:
    """The flag that sets the decode CUDA-graph batch limit for this SGLang."""
    if help_text is not None:
        if NEW_CUDA_GRAPH_FLAG in help_text:
            return NEW_CUDA_GRAPH_FLAG
        if re.search(r"--cuda-graph-max-bs\b(?!-)", help_text):
            return OLD_CUDA_GRAPH_FLAG
    if version is not None and version < (0, 5, 23):
        return OLD_CUDA_GRAPH_FLAG
    return NEW_CUDA_GRAPH_FLAG


def _check_algorithm(drafter: DrafterSpec, version: tuple[int, ...] | None) -> None:
    if drafter.algorithm is None or version is None:
        return
    known = None
    for release, algorithms in sorted(ALGORITHMS_BY_VERSION.items()):
        if version >= release:
            known = algorithms
    if known is not None and drafter.algorithm not in known:
        raise EngineError(
            f"drafter {drafter.name!r}: SGLang {'.'.join(map(str, version))} has no "
            f"{drafter.algorithm} speculative algorithm (it knows {', '.join(known)}); "
            "DFLASH, DSPARK and UNO need SGLang 0.5.23 or newer"
        )


def speculative_args(drafter: DrafterSpec) -> list[str]:
    """The drafter's speculative flags, all-or-none for the EAGLE numbers."""
    if drafter.algorithm is None:
        return []
    args = ["--speculative-algorithm", drafter.algorithm]
    if drafter.draft_model:
        args += ["--speculative-draft-model-path", drafter.draft_model]
    if drafter.algorithm in ("NGRAM", "DFLASH"):
        if drafter.num_draft_tokens is not None:
            args += ["--speculative-num-draft-tokens", str(drafter.num_draft_tokens)]
        return args
    numbers = (drafter.num_steps, drafter.eagle_topk, drafter.num_draft_tokens)
    if all(n is not None for n in numbers):
        args += [
            "--speculative-num-steps",
            str(drafter.num_steps),
            "--speculative-eagle-topk",
            str(drafter.eagle_topk),
            "--speculative-num-draft-tokens",
            str(drafter.num_draft_tokens),
        ]
    elif any(n is not None for n in numbers):
        raise EngineError(
            f"drafter {drafter.name!r}: set num_steps, eagle_topk and "
            "num_draft_tokens all together or none"
        )
    return args


def launch_argv(
    campaign: Campaign,
    drafter: DrafterSpec,
    *,
    port: int,
    help_text: str | None = None,
    version: str | None = None,
) -> list[str]:
    """The full argv (a list: never a shell string) for one drafter's server."""
    sg = campaign.engine.sglang
    parsed = parse_version(version or sg.version)
    _check_algorithm(drafter, parsed)
    largest = max(campaign.workload.batch_sizes)
    argv = [
        *server_command(campaign),
        "--model-path",
        campaign.engine.model,
        "--host",
        sg.host,
        "--port",
        str(port),
        "--tp-size",
        str(campaign.engine.tp_size),
        "--max-running-requests",
        str(largest),
        cuda_graph_flag(help_text, parsed),
        str(largest),
        "--enable-metrics",
        *speculative_args(drafter),
        *sg.extra_args,
        *drafter.extra_args,
    ]
    return argv
