"""The journal's record version, and what every record module shares.

Versions (`journal_schema`, on the header and on each session; the records after a session
follow that session's version, so a journal resumed by a newer dvfs may mix versions):
  1 - measurement keys window_s, sm_clock_mhz and event_reasons, and a nested timeline
      {t_s, power_w, sm_clock_mhz}.
  2 - measurement keys are the quantities' names: decode_time_s, sm_clock_observed_mhz,
      clock_event_reasons, timeline_t_s, timeline_power_w, timeline_sm_clock_mhz (version 1's
      keys are read in `dvfs.records.cell`, and nowhere else).
  3 - the adaptive protocol: measurement keys energy_per_token_rel_ci, latency_rel_ci,
      counter_updates and temperature_start_c; a cell's gpu_time_s (seconds per
      `GPU_TIME_KEYS` entry); a session's counter_update_period_s (per GPU), settle (the
      settle time used, measured or set) and gpu_time_s (its own overheads). Older records lack
      them: NaN, None or empty when read.
      Optional keys added within 3 (absent: older dvfs, or one GPU group): a cell's `worker`
      and `gpus` (the UUIDs of the GPUs that measured it), a fleet session's `workers` (each
      worker's GPUs, host and the block of server ports it claimed first), a server's
      `gpu_pinning` (did it run on the metered GPUs) and `ports` (the block a fleet worker
      started it on: a worker moves to another block when another program takes a port of
      its own), the header's `arms_pinned` (what the dvfs that began the journal gave
      every drafter's server alike: `dvfs.records.session.ARMS_PINNED`; absent, an earlier dvfs
      that did not). A journal may hold sessions on different GPUs of
      one model (`dvfs.records.session.incomparable` names what they must share).
      A cell's optional `foreign_processes` (within 3 too): other tenants' compute processes
      seen on its GPUs at its start or end (gpu, pid, name, at), written only when some were;
      likewise a cell's and a session's optional `idle_foreign_processes`: those seen right
      before or after the idle baseline the cell subtracts (the session's: its opening one).
      A session's optional `idle_from_power_readings` (within 3, written only when true): its
      opening idle measurement is the mean of the instant power readings, not the counter's.
      An in-flight cell's `inflight.context` optional `energy_per_token_drift` (within 3;
      absent: an earlier dvfs carried along an exponential drift, or did not carry, and a
      journal holding such cells is not resumed while cells are left:
      `dvfs.measure.journal.Journal.check_inflight_drift`).
      A session's corpora entries' optional `pool_hash` (within 3): the prompts fitted to the
      input lengths with their token counts (`dvfs.corpora.sampling.pool_hash`).
      A session's optional `campaign_dir` (within 3; absent: an earlier dvfs): the absolute
      folder of the campaign file, where its corpora's relative paths start.
      A server's optional `model_commit` (within 3; absent: an earlier dvfs, or dvfs could
      not tell): the Hugging Face Hub commit of the model it loaded, from its Hub cache.
      A server's optional `model_files` (within 3; absent: an earlier dvfs, or dvfs could
      not tell): that commit's snapshot in the Hub cache, each file's path to its blob.
      A server's optional `running_caps` (within 3; absent: an earlier dvfs, or a server
      that reports none: 0.5.9, the twin): each DP rank's cap on running requests as its
      scheduler reported it at start.
      A session's optional `server_env_prefixes` (within 3, beside `server_env`; absent: an
      earlier dvfs's `dvfs.records.session.EARLIER_ENV_PREFIXES`): the name prefixes its
      `server_env` was recorded under.
      A shard's journal (`dvfs sweep --shard`) has a `shard` record after the header: index,
      count and `deal` ("groups": whole comparison groups); without `deal`, an earlier dvfs
      cut contiguous slices of the cells, and the folder is not resumed (`dvfs.fleet.shard`).
      A cell measurement's optional `prompt_tokens` (within 3; absent: an earlier dvfs): the
      mean input tokens of the prompts its rounds sent, by the session's token count method.
      A cell measurement's optional `throttle_violation_s` (within 3; absent: an earlier
      dvfs): the seconds NVML's thermal and board-limit violation counters grew over its
      rounds, in each round the largest growth of any GPU's counter (null: no GPU could
      tell).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dvfs.errors import JournalError
from dvfs.version import __version__

JOURNAL_SCHEMA = 3
#: The version of a header that names none (journals older than the field).
OLDEST_SCHEMA = 1


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def check_version(where: str | Path, version: object) -> int:
    """The record version, refused when a newer dvfs wrote it (its records may mean else)."""
    if isinstance(version, bool) or not isinstance(version, int) or version > JOURNAL_SCHEMA:
        raise JournalError(
            f"{where} has journal schema {version!r}; this dvfs ({__version__}) reads up to "
            f"{JOURNAL_SCHEMA}: upgrade dvfs, or start over with `dvfs sweep CAMPAIGN --fresh` "
            "(a shard's with its `--shard I/N`)"
        )
    return version


def stored_float(value: Any) -> float:
    """A stored number; null (how strict JSON keeps NaN) and absence read as NaN."""
    return math.nan if value is None else float(value)


def stored_int(value: Any) -> int | None:
    return None if value is None else int(value)


def stored_floats(values: Any) -> tuple[float, ...]:
    """`stored_float` of each (a cell's quantiles and timelines: one list, no call each)."""
    return tuple([math.nan if v is None else float(v) for v in values])
