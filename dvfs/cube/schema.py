"""The cube's schema: its dimensions, variables and CF attributes, and the check that a
dataset has them (every reader goes through it).

Schema history (`attrs["dvfs_schema"]`):
  1 - dims sm_clock, power_limit, batch, drafter, corpus, repeat (+ quantile, sample, and gpu
      when merged); CF `units` and `long_name` on every variable and coordinate. Later
      variables (the intervals, counter_updates, temperature_start_c, gpu_time_*_s) and the
      counter_update_period_s attribute are additions a reader may find absent.
      The energy split (energy_<part>_j, time_<part>_s for prefill, draft, verify and
      overhead, and energy_split_method) is such an addition; NaN (method 0) where a cell's
      record carries none. So is the gpu_pinning attribute (JSON, per drafter: "verified: ...",
      "verified by memory: ..." or "unverified: why", whether its server ran on the metered
      GPUs; absent or "{}" where not checked). So are a shard's `shard` ("I/N") and
      `shard_deal` ("groups"; absent in the cube of a shard an earlier dvfs cut in contiguous
      slices), which `dvfs cube merge` reads.
      So is prompt_tokens (per cell, the mean input tokens of the prompts its rounds sent,
      which the roofline's context reads; NaN where a cell's record carries none).
      So is throttle_violation_s (per cell, the seconds NVML's thermal and board-limit
      violation counters grew over its rounds: in each round the largest growth of any GPU's
      counter; NaN where no GPU could tell or a cell's record carries none).
      So is precision_missed (per cell, 1 where it stopped at measurement.max_rounds with an
      interval wider than measurement.precision: `dvfs.cube.precision`; readers tell it from
      the intervals and the campaign where it is absent).

Missing cells are NaN. Integer-valued variables are stored as integers with a -1 fill value
and read back as floats with NaN where missing (xarray's CF masking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dvfs.errors import CubeError
from dvfs.version import __version__

if TYPE_CHECKING:
    import xarray as xr

CUBE_SCHEMA = 1
CUBE_NAME = "cube.nc"
KNOB_DIMS = ("sm_clock", "power_limit")
#: String-valued axes, written as CF label variables named `<dim>_label`.
LABEL_DIMS = ("drafter", "corpus", "gpu")
#: Variables every analysis reads; a dataset without them is not a usable cube.
REQUIRED_VARIABLES = ("cell_status", "valid", "energy_per_token_j", "ttft_ms", "tpot_ms")
#: Campaign settings that may differ between merged cubes: the GPU is what a merge varies.
MERGE_MAY_DIFFER = ("gpu.backend", "gpu.profile", "gpu.devices")
CELL_DIMS = ("sm_clock", "power_limit", "batch", "drafter", "corpus", "repeat")


@dataclass(frozen=True)
class VarSpec:
    """A cube variable and its CF attributes; its name is also the measured quantity's name in
    the journal (`dvfs.records.MeasurementRecord`), so no variable needs a source key."""

    name: str
    units: str
    long_name: str
    extra_dim: str | None = None
    integer: bool = False


VARIABLES = (
    VarSpec("energy_per_token_j", "J", "energy per output token in the steady-state window"),
    VarSpec(
        "energy_per_token_above_idle_j", "J", "energy per output token above the idle baseline"
    ),
    VarSpec("energy_j", "J", "GPU energy in the steady-state decode window"),
    VarSpec(
        "output_tokens", "1", "output tokens generated in the steady-state window", integer=True
    ),
    VarSpec("decode_time_s", "s", "length of the steady-state decode window"),
    VarSpec("throughput_tok_s", "s-1", "output tokens per second in the steady-state window"),
    VarSpec("ttft_ms", "ms", "time to first token", extra_dim="quantile"),
    VarSpec(
        "tpot_ms", "ms", "time per output token after the first, per request", extra_dim="quantile"
    ),
    VarSpec(
        "itl_ms",
        "ms",
        "inter-token latency (chunk gap spread over its tokens)",
        extra_dim="quantile",
    ),
    VarSpec("accept_length", "1", "mean tokens per verify pass (bonus token included)"),
    VarSpec("accept_rate", "1", "accepted draft tokens over proposed draft tokens"),
    VarSpec(
        "server_accept_length",
        "1",
        "tokens per verify pass as the server reports it (prefill excluded), over each "
        "round's whole blocks of decode_log_interval decode iterations",
    ),
    VarSpec("power_mean_w", "W", "mean GPU power in the steady-state window"),
    VarSpec(
        "power_max_w",
        "W",
        "highest power in the window: a sample, or a round's counter mean where larger",
    ),
    VarSpec("sm_clock_observed_mhz", "MHz", "mean sampled SM clock in the window"),
    VarSpec("temperature_max_c", "degC", "highest sampled GPU temperature in the window"),
    VarSpec(
        "clock_event_reasons",
        "1",
        "NVML clock-event reasons seen in the window (bitmask)",
        integer=True,
    ),
    VarSpec("quality", "1", "measurement quality flags (bitmask)", integer=True),
    VarSpec(
        "valid", "1", "1 if the cell passed every quality check that invalidates", integer=True
    ),
    VarSpec("rounds", "1", "measurement rounds taken to fill the window", integer=True),
    VarSpec("requests", "1", "requests measured", integer=True),
    VarSpec(
        "energy_per_token_rel_ci",
        "1",
        "relative half-width of the Student-t interval on energy per token over the rounds",
    ),
    VarSpec(
        "latency_rel_ci",
        "1",
        "relative half-width of the Student-t interval on median TPOT over the rounds",
    ),
    VarSpec(
        "counter_updates",
        "1",
        "distinct energy-counter updates inside the windows (fewest over the GPUs)",
        integer=True,
    ),
    VarSpec("temperature_start_c", "degC", "hottest GPU's temperature as the cell began"),
    VarSpec(
        "window_tokens",
        "1",
        "output tokens between the windows' counter updates (a step's tokens spread over it)",
    ),
    VarSpec(
        "prompt_tokens",
        "1",
        "mean input tokens of the prompts the cell's rounds sent (the token count method's)",
    ),
    VarSpec(
        "throttle_violation_s",
        "s",
        "time a thermal or board-limit throttle held a GPU below its clocks during the cell's "
        "rounds, by NVML's violation counters read at each round's start and end: in each "
        "round the largest growth of any GPU's thermal or board-limit counter (never a sum: "
        "they may count the same throttle), summed over the rounds (a throttle between two "
        "samples included; NaN: no GPU could tell)",
    ),
)
#: Where each cell's GPU time went (`dvfs.records.GPU_TIME_KEYS`), one variable per entry
#: named gpu_time_<key>_s, plus their total.
GPU_TIME_MEANINGS = {
    "settle": "waiting for the knob change before the cell to take effect",
    "warmup": "the warm-up round",
    "prefill": "each round's start before its steady window (prefill, ramp-up)",
    "window": "the steady-state windows measured",
    "drain": "each round's end after its steady window",
    "idle_baseline": "the idle baseline at the cell's setting",
    "server_start": "starting the server before the cell",
    "stabilise": "thermal stabilisation before the cell",
    "retry": "failed attempts",
}
GPU_TIME = (
    *(
        VarSpec(f"gpu_time_{key}_s", "s", f"GPU time: {meaning}")
        for key, meaning in GPU_TIME_MEANINGS.items()
    ),
    VarSpec("gpu_time_total_s", "s", "GPU time the cell took, overheads before it included"),
)
#: Where each cell's measured energy and time went (`dvfs.records.cell.EnergySplit`), one
#: variable per part (`dvfs.engines.base.SPLIT_PARTS`), named energy_<part>_j and
#: time_<part>_s: over the same windows as energy_j and decode_time_s, to which they add up.
SPLIT_MEANINGS = {
    "prefill": "prefill passes",
    "draft": "the drafter's passes (draft steps, draft-extend, n-gram's host lookup)",
    "verify": "the target's decode passes (the verify pass; every decode step without a drafter)",
    "overhead": "host overhead and idle time the passes leave (scheduling, launches, gaps)",
}
#: `energy_split_method`'s codes: index into `dvfs.records.cell.SPLIT_METHODS`.
SPLIT = (
    *(
        VarSpec(f"energy_{part}_j", "J", f"energy in the windows spent on {meaning}")
        for part, meaning in SPLIT_MEANINGS.items()
    ),
    *(
        VarSpec(f"time_{part}_s", "s", f"time in the windows spent on {meaning}")
        for part, meaning in SPLIT_MEANINGS.items()
    ),
)
SPLIT_METHOD_VAR = "energy_split_method"
TIMELINE = (
    VarSpec(
        "timeline_t_s",
        "s",
        "time since the window start (rounds concatenated)",
        extra_dim="sample",
    ),
    VarSpec("timeline_power_w", "W", "sampled GPU power", extra_dim="sample"),
    VarSpec("timeline_sm_clock_mhz", "MHz", "sampled SM clock", extra_dim="sample"),
)
STATUS_MISSING, STATUS_OK, STATUS_FAILED = 0, 1, 2

COORD_ATTRS = {
    "sm_clock": (
        "MHz",
        "SM clock lock (the stock, unlocked setting is shown at the GPU's max SM clock)",
    ),
    "power_limit": (
        "W",
        "GPU power limit (the stock setting is shown at the limit found at start)",
    ),
    "batch": ("1", "concurrent requests (batch size)"),
    "drafter": ("1", "speculative-decoding configuration"),
    "corpus": ("1", "prompt corpus"),
    "repeat": ("1", "repeat index"),
    "quantile": ("1", "latency quantile"),
    "sample": ("1", "timeline sample index"),
    "gpu": ("1", "GPU UUID"),
}


def check_cube(ds: xr.Dataset, *, where: str = "cube", hint: str = "") -> xr.Dataset:
    """Refuse datasets that are not dvfs cubes of a schema this version reads."""
    then = f": {hint}" if hint else ""
    schema = ds.attrs.get("dvfs_schema")
    if schema is None and str(ds.attrs.get("schema", "")).startswith("dvfs.roofline/"):
        # `dvfs gpu roofline -o`'s file: nothing to rebuild, it is read elsewhere
        raise CubeError(
            f"{where} is a roofline file (`dvfs gpu roofline -o`), not a sweep's cube: fit the "
            f"twin to it with `dvfs twin fit {where} -o PROFILE.toml`, or give it to `dvfs "
            f"compare CUBE --roofline {where}` beside a cube"
        )
    if schema is None:
        raise CubeError(f"{where} is not a dvfs cube (no dvfs_schema attribute){then}")
    try:
        version = int(schema)
    except (TypeError, ValueError):
        raise CubeError(f"{where} has a malformed dvfs_schema {schema!r}{then}") from None
    if version > CUBE_SCHEMA:
        raise CubeError(
            f"{where} has cube schema {schema}; this dvfs ({__version__}) reads up to "
            f"{CUBE_SCHEMA}: upgrade dvfs"
        )
    missing = [d for d in CELL_DIMS if d not in ds.dims or d not in ds.coords]
    if missing:
        raise CubeError(f"{where} lacks dimension(s) {', '.join(missing)}{then}")
    absent = [v for v in REQUIRED_VARIABLES if v not in ds.data_vars]
    if absent:
        raise CubeError(f"{where} lacks variable(s) {', '.join(absent)}{then}")
    problem = _value_problem(ds) or _attribute_problem(ds)
    if problem:
        raise CubeError(f"{where} is damaged: {problem}{then}")
    return ds


#: Attributes dvfs writes as text besides the provenance registry's (`dvfs.provenance`): the
#: campaign file, a merged cube's GPU models and sources, the cells that failed.
TEXT_ATTRIBUTES = (
    "title",
    "history",
    "created",
    "journal_dvfs_version",
    "campaign_source",
    "gpu_names",
    "merged_from",
    "failed_cells",
    "measurement_method",  # a paragraph, not a name
)

#: The longest a provenance name or label ("str" in the registry: a GPU or model name, a local
#: model's path, a method, a version) may be; NVML's names are under 100 characters. Longer is
#: a damaged or hand-edited file, which the commands that print or plot it would choke on (a
#: report's figure titles took minutes at 64 KiB).
MAX_NAME_CHARS = 4096


#: The GPUs' identity as NVML words it, printed inside `cube info`'s, the report's and
#: `compare`'s lines: a newline or a terminal's escape there (a hand-edited cube) broke them.
#: (Not every name: a campaign folder's path may hold any character but '/'.)
ONE_LINE_ATTRIBUTES = ("ecc_mode", "vbios_version")


def _attribute_problem(ds: xr.Dataset) -> str | None:
    """The first attribute the analyses read that holds what they cannot use: a number or a
    list where text goes (its name, a JSON document), text where a number goes (one number,
    or one per GPU), or a name megabytes long; None when all can be. An attribute absent (an
    older cube) is fine."""
    import numbers

    import numpy as np

    from dvfs.provenance import REGISTRY

    kinds = {k.name: k.kind for k in REGISTRY} | dict.fromkeys(TEXT_ATTRIBUTES, "text")
    for name, kind in kinds.items():
        if name not in ds.attrs:
            continue
        value = ds.attrs[name]
        shown = repr(value.tolist() if hasattr(value, "tolist") else value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        if kind in ("str", "json", "text"):
            if not isinstance(value, str):
                return f"its {name} attribute holds {shown}, not text"
            if kind == "str" and len(value) > MAX_NAME_CHARS:
                return (
                    f"its {name} attribute is {len(value)} characters long, not a name (at "
                    f"most {MAX_NAME_CHARS})"
                )
            if name in ONE_LINE_ATTRIBUTES and not value.isprintable():
                return f"its {name} attribute holds {shown}, not a one-line name"
        elif not (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            or isinstance(value, np.ndarray)
            and value.dtype.kind in "iuf"  # one per GPU
        ):
            return f"its {name} attribute holds {shown}, not a number"
        elif kind == "int" and not np.isfinite(np.asarray(value, dtype=float)).all():
            # dvfs writes a whole number there (the stock clock the analyses take as their
            # reference's coordinate): NaN or infinity is a hand-edited cube's
            return f"its {name} attribute holds {shown}, not a whole number"
    return _gpu_names_problem(ds) or _json_shape_problem(ds)


#: JSON attributes the analyses index into, with the container each holds, the kind of its
#: entries and what they are: an entry of another kind stops them.
JSON_SHAPES = {
    "server_args": (dict, dict, "a JSON object of each drafter's server"),
    "failed_cells": (list, dict, "a JSON list of the failed cells"),
    # each corpus's hashes, which `twin fit` and `cube merge` check prompts by: unreadable, it
    # read as an older cube's (none recorded), and nothing was checked
    "corpora": (dict, object, "a JSON object of each corpus's provenance"),
    # a merged cube's sources, each GPU's stock setting, own grid and provenance, which its
    # analyses, summary and report read by the GPU's label
    "merged_from": (dict, dict, "a JSON object of each merged GPU's provenance"),
}


def _json_shape_problem(ds: xr.Dataset) -> str | None:
    """The first of `JSON_SHAPES` that is not JSON or not of its shape; None when all are, or
    are absent or empty."""
    import json

    for name, (container, entry, what) in JSON_SHAPES.items():
        text = ds.attrs.get(name)
        if not isinstance(text, str) or not text.strip():
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        entries = value.values() if isinstance(value, dict) else value
        if not isinstance(value, container) or not all(isinstance(e, entry) for e in entries):
            shown = text if len(text) <= 60 else text[:57] + "..."
            return f"its {name} attribute holds {shown!r}, not {what}"
    return None


def _gpu_names_problem(ds: xr.Dataset) -> str | None:
    """A merged cube's `gpu_names` (each GPU's model, which its analyses label and split
    rooflines by) that is not a JSON list of one name per GPU; None when it is, or absent."""
    import json

    text = ds.attrs.get("gpu_names")
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    gpus = ds.sizes.get("gpu")
    if (
        not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or (gpus is not None and len(names) != gpus)
    ):
        shown = text if len(text) <= 60 else text[:57] + "..."
        each = f"{gpus} GPU models" if gpus is not None else "GPU models"
        return f"its gpu_names attribute holds {shown!r}, not a JSON list of {each}, one per GPU"
    return None


#: Numeric coordinates the analyses index and label with: each value must be a finite number.
NUMERIC_COORDS = ("sm_clock", "power_limit", "batch", "repeat", "quantile")


def _value_problem(ds: xr.Dataset) -> str | None:
    """The first coordinate or measured variable whose values no analysis can use (text where
    numbers go, a NaN clock, a latency without its quantile axis); None when all can be."""
    import numpy as np

    # `ds.variables`, not `ds[name]`: a DataArray built for each look took 70% of a small
    # cube's check
    variables = ds.variables
    for name in NUMERIC_COORDS:
        if name not in ds.coords:
            continue
        values = variables[name].values
        if values.dtype.kind not in "iuf" or not np.isfinite(values).all():
            return f"its {name} coordinate holds {values.tolist()[:4]!r}, not finite numbers"
    from dvfs.measure.meter import QUANTILES

    if "quantile" in ds.coords and variables["quantile"].values.tolist() != list(QUANTILES):
        # The analyses select each quantile by value, and the median as the first.
        shown = variables["quantile"].values.tolist()[:4]
        return f"its quantile coordinate holds {shown!r}, not the latencies' {list(QUANTILES)!r}"
    # An axis naming one entry twice (a hand-edited label, a clock written twice): selecting
    # it gives two rows where one is meant, and the analyses would mix them or fail.
    for name in (*CELL_DIMS, "gpu", "quantile", "sample"):
        if name not in ds.coords or variables[name].dims != (name,):
            continue
        seen: set[object] = set()
        for value in variables[name].values.tolist():
            if value in seen:
                return f"its {name} coordinate names {value!r} more than once"
            seen.add(value)
    numeric = {v.name for v in (*VARIABLES, *GPU_TIME, *SPLIT, *TIMELINE)}
    numeric |= set(REQUIRED_VARIABLES)
    for name in sorted(numeric & set(ds.data_vars)):
        var = variables[name]
        if var.dtype.kind not in "biuf":
            return f"variable {name} holds {var.dtype} values, not numbers"
        missing = [d for d in var.dims if d not in ds.coords]
        if missing:
            return f"variable {name} has no {missing[0]} coordinate"
    return None
