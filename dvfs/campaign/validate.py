"""Loading a campaign file: every table validated, one `CampaignError` for the first mistake.

The error names the file, the key, the value and what is allowed, before anything touches a
GPU. The [gpu], [knobs], [workload] and [measurement] tables are checked here; [engine] and
[drafters.*] in `dvfs.campaign.serving`.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any

from dvfs.campaign.model import (
    INFLIGHT_ORDERS,
    MEASUREMENT_MODES,
    MODES,
    NAME_RE,
    ROUND_ENDS,
    WARMUP_EVERY,
    Campaign,
    CorpusRef,
    DrafterSpec,
    GpuConfig,
    KnobConfig,
    MeasurementConfig,
    WorkloadConfig,
    show,
)
from dvfs.campaign.serving import parse_drafter, parse_engine
from dvfs.campaign.table import Table
from dvfs.errors import CampaignError
from dvfs.gpu.base import canonical_uuid
from dvfs.toml_text import refuse_beyond_64_bits

#: The most repeats a cell may take: a journal's stored campaign asking more is read back as
#: an edited one (`dvfs.records.header`'s bound on its counts), so no cube could be built.
MOST_REPEATS = 1 << 20

TOP_LEVEL = ("campaign", "gpu", "knobs", "engine", "drafters", "workload", "measurement", "corpus")


def _gpu(table: Table) -> GpuConfig:
    backend = table.string("backend", "twin", choices=("twin", "nvml"))
    profile = table.string("profile")
    if backend == "twin":
        from dvfs.twin.profiles import gpu_profile, gpu_profiles

        profiles = tuple(sorted(gpu_profiles()))
        if profile is None:
            raise table.fail(
                "profile", f"the twin needs a GPU profile; choose one of {', '.join(profiles)}"
            )
        if profile.partition(":")[0] not in profiles:
            raise table.fail(
                "profile", f"unknown twin profile {profile!r}; choose one of {', '.join(profiles)}"
            )
        try:  # KEY:TRAPS, which of NVML's traps the twin simulates
            gpu_profile(profile)
        except CampaignError as exc:
            raise table.fail("profile", str(exc)) from exc
    devices = table.get("devices", [0])
    if not isinstance(devices, list) or not devices:
        raise table.fail(
            "devices", f"expected a non-empty list of GPU indices or UUIDs, got {show(devices)}"
        )
    devices = [_device(d) for d in devices]
    groups = _device_groups(table, devices)
    if groups:
        devices = [d for group in groups for d in group]
    for device in devices:
        ok_index = isinstance(device, int) and not isinstance(device, bool) and device >= 0
        ok_uuid = isinstance(device, str) and device.upper().startswith(("GPU-", "MIG-"))
        if not (ok_index or ok_uuid):
            raise table.fail(
                "devices",
                f"{show(device)} is neither a GPU index (0, 1, ...) nor a UUID (GPU-...)",
            )
    if len(set(devices)) != len(devices):
        raise table.fail("devices", "lists a GPU twice")
    actuation = table.string("actuation", "on", choices=("on", "off"))
    table.finish()
    return GpuConfig(backend, profile, tuple(devices), actuation == "on", groups)


def _device(device: Any) -> Any:
    """An entry of gpu.devices (a group's: a list of them) with its GPU UUIDs in NVML's case
    (`canonical_uuid`: pasted upper-cased, they name the same GPU)."""
    if isinstance(device, list):
        return [_device(d) for d in device]
    return canonical_uuid(device) if isinstance(device, str) else device


def _device_groups(table: Table, devices: list[Any]) -> tuple[tuple[Any, ...], ...]:
    """`devices = [[0, 1], [2, 3]]`: one worker per group (a tensor-parallel server each),
    all groups the same size; () for a flat list (one server on all of them)."""
    if not any(isinstance(d, list) for d in devices):
        return ()
    if not all(isinstance(d, list) and d for d in devices):
        raise table.fail(
            "devices",
            "mixes GPUs and groups; give a list of GPUs, or a list of non-empty groups "
            "(lists of GPUs: one tensor-parallel server each)",
        )
    sizes = {len(group) for group in devices}
    if len(sizes) > 1:
        raise table.fail(
            "devices",
            f"groups of different sizes {sorted(sizes)}; every group is one server "
            "of engine.tp_size GPUs",
        )
    return tuple(tuple(group) for group in devices)


def _clock_list(table: Table, value: Any) -> tuple[int, ...] | None:
    if value == "stock":
        return None
    if isinstance(value, dict):
        rng = Table(table.where, table.key("sm_clock"), value)
        start = rng.integer("start", minimum=1)
        stop = rng.integer("stop", minimum=1)
        step = rng.integer("step", minimum=1)
        rng.finish()
        if start is None or stop is None or step is None:
            raise table.fail("sm_clock", "a range needs start, stop and step (MHz)")
        if start > stop:
            raise table.fail("sm_clock", f"start {start} is above stop {stop}")
        if (stop - start) % step:
            raise table.fail(
                "sm_clock", f"stop {stop} is not reached from {start} in steps of {step}"
            )
        levels = (stop - start) // step + 1
        if levels > MOST_CLOCK_LEVELS:  # counted, not listed: a list that long fills memory
            raise table.fail(
                "sm_clock",
                f"{start}-{stop} MHz in steps of {step} is {levels:,} clocks, more than a "
                f"campaign may step through ({MOST_CLOCK_LEVELS:,} at most, each a cell at "
                "least); give a stop within the GPU's clocks or a larger step",
            )
        return tuple(range(start, stop + 1, step))
    if isinstance(value, list) and value:
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise table.fail("sm_clock", f"expected positive integers (MHz), got {show(value)}")
        if len(set(value)) != len(value):
            raise table.fail("sm_clock", "lists a clock twice")
        return tuple(value)
    raise table.fail(
        "sm_clock",
        f'expected "stock", a list of MHz values, or {{start, stop, step}}; got {show(value)}',
    )


def _knobs(table: Table, gpu: GpuConfig) -> KnobConfig:
    clocks = _clock_list(table, table.get("sm_clock", "stock"))
    limits_raw = table.get("power_limit", "stock")
    limits: tuple[float, ...] | None
    if limits_raw == "stock":
        limits = None
    elif (
        isinstance(limits_raw, list)
        and limits_raw
        and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in limits_raw
        )
    ):
        if len(set(limits_raw)) != len(limits_raw):
            raise table.fail("power_limit", "lists a power limit twice")
        limits = tuple(float(v) for v in limits_raw)
    else:
        raise table.fail(
            "power_limit", f'expected "stock" or a list of watts, got {show(limits_raw)}'
        )
    settle_s = table.seconds("settle_s", 2.0, minimum=0.0)
    table.finish()
    if gpu.backend == "twin" and gpu.profile:
        from dvfs.gpu.base import unsupported_clock
        from dvfs.twin.profiles import gpu_profile

        profile = gpu_profile(gpu.profile)
        supported = set(profile.supported_sm_clocks_mhz())
        for clock in clocks or ():
            problem = unsupported_clock(clock, supported, of=f" of {gpu.profile}")
            if problem:
                raise table.fail("sm_clock", f"{problem}, in {profile.sm_clock_step_mhz} MHz steps")
        allowed = profile.power_limit_range()
        for limit in limits or ():
            problem = allowed.outside(limit * 1000)
            if problem:
                raise table.fail("power_limit", f"{gpu.profile}: {problem}")
    if not gpu.actuation and (clocks or limits):
        raise table.fail(
            "sm_clock" if clocks else "power_limit",
            'gpu.actuation is "off" (observe-only): knobs must be "stock"',
        )
    return KnobConfig(clocks, limits, settle_s)


def _token_range(table: Table, name: str, default: Any) -> tuple[int, int]:
    value = table.get(name, default)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return (value, value)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        and value[0] <= value[1]
    ):
        return (value[0], value[1])
    raise table.fail(name, f"expected a positive integer or [min, max], got {show(value)}")


def _workload(table: Table, user_corpora: dict[str, Any]) -> WorkloadConfig:
    batches = table.require("batch")
    if (
        not isinstance(batches, list)
        or not batches
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches)
    ):
        raise table.fail("batch", f"expected a list of positive integers, got {show(batches)}")
    if len(set(batches)) != len(batches):
        raise table.fail("batch", "lists a batch size twice")
    corpus_names = table.strings("corpora")
    if not corpus_names:
        raise table.fail("corpora", "name at least one corpus")
    if len(set(corpus_names)) != len(corpus_names):
        raise table.fail("corpora", "lists a corpus twice")
    from dvfs.corpora import BUILTIN_CORPORA

    refs = []
    for name in corpus_names:
        if name in user_corpora:
            spec = user_corpora[name]
            refs.append(CorpusRef(name, tuple(sorted(spec.items()))))
        elif name in BUILTIN_CORPORA:
            refs.append(CorpusRef(name))
        else:
            choices = sorted(set(BUILTIN_CORPORA) | set(user_corpora))
            hint = difflib.get_close_matches(name, choices, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise table.fail(
                "corpora",
                f"unknown corpus {name!r}{suggestion}; built-in corpora are "
                f"{', '.join(BUILTIN_CORPORA)}, or define your own in a [corpus.{name}] table",
            )
    input_tokens = _token_range(table, "input_tokens", [16, 4096])
    output_tokens = table.integer("output_tokens", 256, minimum=2)
    mode = table.string("mode", "fixed", choices=MODES)
    temperature = table.number("temperature", 0.0, minimum=0.0)
    ignore_eos = table.boolean("ignore_eos", mode == "fixed")
    pool_size = table.integer("pool_size", minimum=1)
    table.finish()
    if mode == "fixed" and not ignore_eos:
        raise table.fail(
            "ignore_eos",
            "fixed-batch mode needs ignore_eos = true so every request decodes output_tokens",
        )
    if pool_size is not None and pool_size <= max(batches):
        # a pool no larger than the batch drains below it at once: the runner refuses it
        raise table.fail(
            "pool_size",
            f"{pool_size} is not larger than the largest batch ({max(batches)}): a closed-loop "
            "pool needs more prompts than the batch keeps in flight",
        )
    return WorkloadConfig(
        tuple(batches),
        tuple(refs),
        input_tokens,
        output_tokens,
        mode,
        temperature,
        ignore_eos,
        pool_size,
    )


#: The most clocks an sm_clock range may step through: each is a cell at least, and no campaign
#: plans more cells than a dry run lists (`dvfs.measure.plan.MOST_LISTED_CELLS`). A stop of
#: 2**63 - 1 was listed in full: "out of memory", exit 1.
MOST_CLOCK_LEVELS = 1_000_000

#: The least measurement.thermal_slope_c_per_min: a slope is told from NVML's whole-degree
#: readings over 60 x 1 C / slope seconds (`dvfs.measure.baseline.slope_window_s`), 600000 s
#: here, under the week a campaign's durations are held to (`dvfs.campaign.table.MAX_SECONDS`);
#: 1e-300 made that window infinite, an internal error ("cannot convert float infinity to
#: integer").
MIN_THERMAL_SLOPE_C_PER_MIN = 1e-4

#: The shortest measurement.sample_period_s: NVML's energy counter moves every 20-100 ms and a
#: read of it takes the order of a millisecond, so a shorter period reads the same value again,
#: no faster; and the twin samples every period of every window, so 1e-9 s ran its dry run
#: (1e9 samples a one-second window) for minutes.
MIN_SAMPLE_PERIOD_S = 0.001


def _measurement(table: Table) -> MeasurementConfig:
    m = MeasurementConfig(
        warmup_tokens=table.integer("warmup_tokens", 32, minimum=0),
        min_window_s=table.seconds("min_window_s", 1.0, strictly_positive=True),
        max_rounds=table.integer("max_rounds", 32, minimum=1),
        repeats=table.integer("repeats", 1, minimum=1),
        seed=table.integer("seed", 0, minimum=0),
        sample_period_s=table.seconds("sample_period_s", 0.02, minimum=MIN_SAMPLE_PERIOD_S),
        idle_s=table.seconds("idle_s", 5.0, minimum=0.0),
        retries=table.integer("retries", 2, minimum=0),
        **_protocol(table),
    )
    table.finish()
    if m.max_repeats < m.repeats:
        raise table.fail(
            "max_repeats",
            f"{m.max_repeats} is below repeats = {m.repeats}: repeats is the minimum, "
            "max_repeats the most a cell may take; use at least repeats",
        )
    if m.max_repeats > MOST_REPEATS:  # else measured, then its journal refused by cube build
        key = "max_repeats" if "max_repeats" in table.data else "repeats"
        raise table.fail(
            key,
            f"{m.max_repeats} is more repeats than a cube holds; use at most {MOST_REPEATS}",
        )
    if m.sample_period_s * 5 > m.min_window_s:
        raise table.fail(
            "sample_period_s",
            f"{m.sample_period_s:g} s is too coarse for min_window_s = {m.min_window_s:g} s: a "
            "window needs several samples of the energy counter; use at most min_window_s / 5",
        )
    return m


def _protocol(table: Table) -> dict[str, Any]:
    """The [measurement] keys of the adaptive protocol: precision and its confidence, adaptive
    repeats, in-flight stepping, settle, thermal stabilisation and idle baselines."""
    precision = table.number("precision", 0.01, strictly_positive=True)
    if precision >= 1:
        raise table.fail(
            "precision",
            f"{precision:g} is a relative half-width: use a fraction below 1 (0.01 = ±1%)",
        )
    confidence = table.number("confidence", 0.95, strictly_positive=True)
    if confidence >= 1:
        raise table.fail(
            "confidence", f"must be a fraction between 0 and 1 (e.g. 0.95), got {confidence:g}"
        )
    repeats = table.get("repeats", 1)
    max_repeats = table.integer("max_repeats", repeats if isinstance(repeats, int) else 1)
    if max_repeats is not None and max_repeats < 1:
        raise table.fail("max_repeats", f"must be at least 1, got {max_repeats}")
    settle: Any = table.get("settle", "measured")
    if isinstance(settle, str):
        if settle != "measured":
            raise table.fail(
                "settle", f'{settle!r} is not allowed; use "measured" or a number of seconds'
            )
    else:
        settle = table.seconds("settle", minimum=0.0)
    return {
        "precision": precision,
        "confidence": confidence,
        "max_repeats": max_repeats,
        "mode": table.string("mode", "per-level", choices=MEASUREMENT_MODES),
        "inflight_order": table.string("inflight_order", "abba", choices=INFLIGHT_ORDERS),
        "round_end": table.string("round_end", ROUND_ENDS[0], choices=ROUND_ENDS),
        "warmup_every": table.string("warmup_every", WARMUP_EVERY[0], choices=WARMUP_EVERY),
        "settle": settle,
        "thermal_slope_c_per_min": table.number(
            "thermal_slope_c_per_min",
            1.0,
            strictly_positive=True,
            minimum=MIN_THERMAL_SLOPE_C_PER_MIN,
        ),
        "thermal_max_s": table.seconds("thermal_max_s", 120.0, minimum=0.0),
        "idle_per_setting": table.boolean("idle_per_setting", True),
    }


def parse_campaign(
    data: dict[str, Any], *, where: str = "campaign", source: str = "", base_dir: str = "."
) -> Campaign:
    """Validate a parsed TOML document into a `Campaign`."""
    top = Table(where, "", data)
    meta = top.sub("campaign")
    name = meta.string("name")
    if name is None:
        name = Path(where).stem
        if not NAME_RE.match(name):
            raise CampaignError(
                f"{where}: the file name {name!r} cannot name the campaign (it names the output "
                "folder): set [campaign] name, using letters, digits, '_', '-' and '.'"
            )
    elif not NAME_RE.match(name):
        raise meta.fail(
            "name",
            f"{name!r} cannot be used: the name becomes a folder (out/<name>), so it must start "
            "with a letter or digit and use only letters, digits, '_', '-' and '.'",
        )
    description = meta.string("description", "")
    meta.finish()
    gpu = _gpu(top.sub("gpu"))
    knobs = _knobs(top.sub("knobs"), gpu)
    engine = parse_engine(top.sub("engine", required=True), gpu)
    drafter_tables = top.sub("drafters")
    drafters = []
    for drafter_name in drafter_tables.data:
        drafter_tables.used.add(drafter_name)
        drafters.append(parse_drafter(drafter_tables.sub(drafter_name), drafter_name, engine))
    if not drafters:
        drafters = [DrafterSpec("none")]
    user_corpora_table = top.sub("corpus")
    user_corpora: dict[str, Any] = {}
    for corpus_name, spec in user_corpora_table.data.items():
        user_corpora_table.used.add(corpus_name)
        if not isinstance(spec, dict):
            raise CampaignError(f"{where}: [corpus.{corpus_name}] must be a table")
        if not NAME_RE.match(corpus_name):
            raise CampaignError(
                f"{where}: corpus name {corpus_name!r} must start with a letter or digit and "
                "use only letters, digits, '_', '-', '.'"
            )
        from dvfs.corpora import validate_spec

        validate_spec(corpus_name, spec, where=where)
        user_corpora[corpus_name] = spec
    workload = _workload(top.sub("workload", required=True), user_corpora)
    measurement = _measurement(top.sub("measurement"))
    top.finish()
    if engine.backend == "sglang" and engine.sglang.url is not None and len(drafters) > 1:
        raise CampaignError(
            f"{where}: engine.sglang.url attaches to one running server, so the campaign can have "
            "only one drafter, the one that server runs (dvfs checks its model and algorithm); "
            f"found {len(drafters)}"
        )
    return Campaign(
        name=name,
        description=description,
        gpu=gpu,
        knobs=knobs,
        engine=engine,
        drafters=tuple(drafters),
        workload=workload,
        measurement=measurement,
        source=source,
        base_dir=base_dir,
    )


def _built_in_hint(path: Path) -> str:
    """Where a campaign dvfs ships by the missing file's name is (the README's
    `sweeps/demo.toml` is only there in a clone of the repository): "" when none is."""
    from importlib import resources

    try:
        shipped = resources.files("dvfs.campaigns").joinpath(f"{path.stem}.toml")
        if not shipped.is_file():
            return ""
    except (OSError, ValueError):
        return ""
    return (
        f"; dvfs ships a {path.stem!r} campaign at {shipped} (`dvfs demo` runs the demo; copy "
        "the file to start a campaign of your own)"
    )


def _demo_hint() -> str:
    """Where the demo campaign dvfs ships is, in parentheses ("" when not found)."""
    from importlib import resources

    try:
        shipped = resources.files("dvfs.campaigns").joinpath("demo.toml")
        return f" ({shipped})" if shipped.is_file() else ""
    except (OSError, ValueError):
        return ""


def load_campaign(path: str | Path) -> Campaign:
    """Read and validate a campaign file."""
    from dvfs.inputs import (
        MAX_SETTINGS_BYTES,
        TOO_DEEP,
        file_in_the_way,
        link_loop_problem,
        read_text_limited,
    )

    path = Path(path)
    try:
        text = read_text_limited(path, MAX_SETTINGS_BYTES, CampaignError, "campaign file")
    except FileNotFoundError as exc:
        raise CampaignError(f"campaign file {path} does not exist{_built_in_hint(path)}") from exc
    except NotADirectoryError as exc:
        # `afile/c.toml`: "cannot read campaign file afile/c.toml: Not a directory" said
        # neither which part nor what to do
        raise CampaignError(
            f"campaign file {path} does not exist: {file_in_the_way(path)} is a file, not a "
            "folder; check the path"
        ) from exc
    except OSError as exc:
        # a link in a loop: "Too many levels of symbolic links" said neither which link nor
        # what to do; said as the other paths read say it
        loop = link_loop_problem(path)
        if loop:
            raise CampaignError(f"campaign file: {loop}") from exc
        raise CampaignError(f"cannot read campaign file {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CampaignError(f"{path}: not valid TOML: {exc}") from exc
    except RecursionError as exc:
        raise CampaignError(
            f"{path}: not valid TOML: {TOO_DEEP} (a damaged file?); check the file"
        ) from exc
    refuse_beyond_64_bits(data, str(path), CampaignError)
    if not data:  # else refused for the first setting it lacks, as if the rest were there
        what = "holds no settings, only comments" if text.strip() else "is empty"
        raise CampaignError(
            f"campaign file {path} {what}: is it the campaign file? Write its settings, or copy "
            f"the demo campaign dvfs ships{_demo_hint()} to start one"
        )
    return parse_campaign(data, where=str(path), source=text, base_dir=str(path.parent.resolve()))
