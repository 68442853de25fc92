"""The registry of a cube's provenance attributes: type, unit, meaning, and whether cubes that
differ in it may be merged (merging measurements of different models would mislead)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProvenanceKey:
    name: str
    kind: str
    unit: str
    meaning: str
    must_match: bool = False
    #: Compared only where both cubes record it (empty or absent: an older dvfs's cube, or an
    #: engine that does not say), so that older cubes still merge.
    when_known: bool = False


REGISTRY = tuple(
    ProvenanceKey(*row)
    for row in (
        ("dvfs_schema", "int", "", "cube schema version", True),
        ("dvfs_version", "str", "", "dvfs version that wrote the cube"),
        ("campaign_name", "str", "", "campaign name"),
        ("campaign_hash", "str", "", "hash of the campaign's measured content"),
        ("campaign", "json", "", "the validated campaign"),
        (
            "campaign_dir",
            "str",
            "",
            "absolute folder of the campaign file, where its corpora's relative paths start "
            "(empty: not recorded: an earlier dvfs, or a folder name that is not UTF-8)",
        ),
        ("gpu_backend", "str", "", "nvml or twin"),
        ("gpu_name", "str", "", "NVML device name"),
        ("gpu_uuids", "str", "", "comma-separated GPU UUIDs"),
        (
            "gpu_count",
            "int",
            "",
            "GPUs the cube's cells were measured on (every session's, fleet worker's and "
            "shard's: the GPUs in gpu_uuids; one server spans tp_size of them)",
        ),
        ("driver_version", "str", "", "NVIDIA driver version"),
        ("memory_clock_mhz", "int", "MHz", "memory clock"),
        (
            "ecc_mode",
            "str",
            "",
            "the GPUs' ECC mode: on, off or unsupported (absent: not read: the twin, an "
            "earlier dvfs; a merged cube's: each GPU's, comma-joined)",
        ),
        (
            "vbios_version",
            "str",
            "",
            "the GPUs' VBIOS version (absent: not read: the twin, an earlier dvfs; a merged "
            "cube's: each GPU's, comma-joined)",
        ),
        ("twin_profile", "str", "", "twin GPU profile, if simulated"),
        ("engine_backend", "str", "", "sglang or twin", True),
        ("engine_version", "str", "", "engine version(s)", True, True),
        (
            "server_args",
            "json",
            "",
            "resolved server arguments per drafter (with running_caps, each DP rank's cap on "
            "running requests as its scheduler reported it, where it reported one)",
        ),
        ("arms_pinned", "str", "", "what dvfs gave every drafter's server alike (comma-separated)"),
        (
            "server_env",
            "json",
            "",
            "the servers' environment variables that change kernels or scheduling (empty: not "
            "recorded: the twin, an attached server, an older dvfs)",
            True,
            True,
        ),
        (
            "server_env_prefixes",
            "str",
            "",
            "the name prefixes server_env was recorded under, comma-separated (empty: an earlier "
            "dvfs's, or none recorded)",
        ),
        ("gpu_pinning", "json", "", "per drafter: did its server run on the metered GPUs"),
        ("model", "str", "", "target model", True),
        ("tp_size", "int", "", "tensor-parallel size", True),
        ("actuation", "int", "", "1 if dvfs changed knobs, 0 if observe-only"),
        ("clock", "str", "", "virtual or monotonic time"),
        ("stock_sm_clock_mhz", "int", "MHz", "the stock (unlocked) clock's coordinate"),
        ("stock_power_limit_w", "float", "W", "the stock power limit's coordinate"),
        (
            "stock_power_limit_enforced",
            "str",
            "",
            "the GPUs (UUIDs, comma-separated) whose power limit NVML does not support, whose "
            "stock power limit is the one NVML said was enforced (absent: every GPU's is its "
            "configured limit; power_limit_range_w NaN for such a GPU)",
        ),
        (
            "power_limit_found_w",
            "float",
            "W",
            "the power limits found at start that were caps dvfs applied, lifted while "
            "measuring stock (absent: the limit found was the stock)",
        ),
        (
            "power_limit_found_gpus",
            "json",
            "W",
            "power_limit_found_w by the UUID of the GPU each was found on (absent: none "
            "lifted, or an earlier dvfs's cube, which did not say which GPU)",
        ),
        ("idle_power_w", "float", "W", "idle board power, all GPUs"),
        (
            "idle_foreign_processes",
            "json",
            "",
            "other tenants' compute processes seen around the opening idle measurements (their "
            "work is in idle_power_w; empty: none seen)",
        ),
        (
            "idle_from_power_readings",
            "int",
            "",
            "1: a session's opening idle measurement is the mean of the instant power readings "
            "(an energy counter updated less than twice in it, or measurement.idle_s = 0 read "
            "the power once), so idle_power_w is less exact",
        ),
        (
            "counter_update_period_s",
            "float",
            "s",
            "each GPU's energy-counter update period, detected at session start",
        ),
        ("measurement_method", "str", "", "how energy, windows and latency are measured", True),
        ("token_count_method", "str", "", "how prompt tokens were counted", True, True),
        (
            "prompt_format",
            "str",
            "",
            "how prompts went out: chat_template:<hash> or plain (empty: the twin's, none)",
            True,
            True,
        ),
        (
            "corpora",
            "json",
            "",
            "each corpus's source, content hash and size (merging compares the hashes)",
        ),
    )
)
CHECKED = tuple(k.name for k in REGISTRY if k.must_match)
#: The `CHECKED` keys compared only where both cubes record them.
WHEN_KNOWN = tuple(k.name for k in REGISTRY if k.when_known)
