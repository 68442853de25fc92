"""The twin's data: GPU specs, model shapes and acceptance priors, read from TOML with sources."""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

from dvfs.errors import CampaignError
from dvfs.gpu.base import PowerLimitRange

#: Where `GpuProfile.__hash__` keeps the hash it worked out, beside the fields.
_HASH = "_fields_hash"


@dataclass(frozen=True)
class GpuProfile:
    """Datasheet and calibration figures of one GPU model (units in each name)."""

    key: str
    nvml_name: str
    sm_count: int
    flop_per_clk_per_sm: int
    gemm_efficiency: float
    hbm_bandwidth_gb_s: float
    hbm_efficiency: float
    bandwidth_knee_mhz: float
    memory_clock_mhz: int
    memory_gb: float
    max_sm_clock_mhz: int
    min_sm_clock_mhz: int
    sm_clock_step_mhz: int
    idle_sm_clock_mhz: int
    idle_power_w: float
    power_limit_min_w: float
    power_limit_max_w: float
    power_limit_default_w: float
    voltage_min_v: float
    voltage_max_v: float
    voltage_knee_mhz: float
    sm_active_power_w: float
    tensor_power_w: float
    memory_power_w: float
    ambient_c: float
    thermal_c_per_w: float
    kernel_cycles_per_layer: float
    host_overhead_s: float
    nvlink_gb_s: float
    #: The memory NVML (and nvidia-smi's memory.total, which SGLang reads) reports, MiB; 0:
    #: unknown, taken as `memory_gb` GiB.
    memory_total_mib: int = 0
    # The speculative iteration's costs beyond one forward pass (`dvfs.twin.physics`); each
    # default leaves its term out. GEMM tiles: rows per output tile (tile quantisation in the
    # token count M) and output-column tiles per row of tiles (wave quantisation over the SMs).
    gemm_tile_tokens: int = 0
    gemm_n_tiles: int = 0
    #: Bandwidth a verify pass's custom-mask attention reaches on the KV cache, relative to
    #: plain decode attention.
    verify_attention_efficiency: float = 1.0
    #: Host time of a speculative step (its verify pass), whole and per request and per
    #: verified token (scheduling, sampling, tree and KV-slot bookkeeping), not overlapped
    #: with the GPU.
    spec_host_per_step_s: float = 0.0
    spec_host_per_request_s: float = 0.0
    spec_host_per_token_s: float = 0.0
    # NVML's measurement traps (`dvfs.twin.traps`): each 0 turns its trap off.
    energy_counter_period_s: float = 0.0
    power_sampled_s: float = 0.0
    power_average_s: float = 0.0
    thermal_time_constant_s: float = 0.0
    leakage_w_per_c: float = 0.0
    idle_clock_power_w: float = 0.0
    settle_time_s: float = 0.0
    settle_overshoot: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.verify_attention_efficiency <= 1.0:
            raise CampaignError(
                f"GPU profile {self.key}: verify_attention_efficiency must be in (0, 1], "
                f"not {self.verify_attention_efficiency}"
            )
        negative = [
            name
            for name in (
                "gemm_tile_tokens",
                "gemm_n_tiles",
                "spec_host_per_step_s",
                "spec_host_per_request_s",
                "spec_host_per_token_s",
            )
            if getattr(self, name) < 0
        ]
        if negative:
            raise CampaignError(f"GPU profile {self.key}: {', '.join(negative)} must be >= 0")

    def __hash__(self) -> int:
        """The hash of every field, as the dataclass's own hash is (so equal profiles hash
        equal), worked out once: a profile keys the physics' caches, looked up a few times per
        round of a sweep, and hashing its forty-odd fields took microseconds each time. The
        fields are frozen, so the hash kept beside them cannot go stale; it is left out of a
        pickle (`__getstate__`), as a string's hash differs from process to process."""
        known = self.__dict__.get(_HASH)
        if known is None:
            known = self.__dict__[_HASH] = hash(tuple(getattr(self, f.name) for f in fields(self)))
        return known

    def __getstate__(self) -> dict[str, Any]:
        """The fields alone (what a pickle or a copy carries), without the kept hash."""
        return {k: v for k, v in self.__dict__.items() if k != _HASH}

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Lockable SM clocks, descending like NVML's list."""
        return tuple(
            range(self.max_sm_clock_mhz, self.min_sm_clock_mhz - 1, -self.sm_clock_step_mhz)
        )

    def power_limit_range(self) -> PowerLimitRange:
        """The settable power limits in NVML's units, as the twin's GPU reports them."""
        return PowerLimitRange(
            min_mw=round(self.power_limit_min_w * 1000),
            max_mw=round(self.power_limit_max_w * 1000),
            default_mw=round(self.power_limit_default_w * 1000),
        )

    def peak_flops(self, sm_clock_mhz: float) -> float:
        """Dense BF16 tensor FLOP/s at an SM clock (achievable, GEMM efficiency applied)."""
        return self.sm_count * self.flop_per_clk_per_sm * sm_clock_mhz * 1e6 * self.gemm_efficiency

    def memory_mib(self) -> float:
        """The GPU's memory as SGLang sizes its pools from it (MiB)."""
        return float(self.memory_total_mib or self.memory_gb * 1024)

    def ridge_point(self, sm_clock_mhz: float) -> float:
        """FLOP per byte where a pass's compute time equals its memory time (datasheet peaks)."""
        peak = self.sm_count * self.flop_per_clk_per_sm * sm_clock_mhz * 1e6
        return peak / (self.hbm_bandwidth_gb_s * 1e9)


#: Each trap's fields and the value that turns it off.
TRAPS: dict[str, dict[str, float]] = {
    "energy_steps": {"energy_counter_period_s": 0.0},
    "part_time_power": {"power_sampled_s": 0.0},
    "power_average": {"power_average_s": 0.0},
    "thermal_lag": {"thermal_time_constant_s": 0.0},
    "leakage": {"leakage_w_per_c": 0.0},
    "idle_clock_power": {"idle_clock_power_w": 0.0},
    "settle": {"settle_time_s": 0.0, "settle_overshoot": 0.0},
}


def _check(names: tuple[str, ...]) -> None:
    unknown = sorted(set(names) - set(TRAPS))
    if unknown:
        raise ValueError(f"unknown trap(s) {', '.join(unknown)}; known: {', '.join(TRAPS)}")


def without(profile: GpuProfile, *names: str) -> GpuProfile:
    """`profile` with the named traps off (every trap when none is named)."""
    _check(names)
    off: dict[str, float] = {}
    for name in names or tuple(TRAPS):
        off.update(TRAPS[name])
    return dataclasses.replace(profile, **off)  # type: ignore[arg-type]


def only(profile: GpuProfile, *names: str) -> GpuProfile:
    """`profile` with every trap off but the named ones (all named: `profile` as it is)."""
    _check(names)
    drop = tuple(n for n in TRAPS if n not in names)
    # `without` with no names turns every trap off: naming them all kept none
    return without(profile, *drop) if drop else profile


def active(profile: GpuProfile) -> tuple[str, ...]:
    """The traps `profile` simulates."""
    return tuple(
        name
        for name, switched in TRAPS.items()
        if any(getattr(profile, f) != v for f, v in switched.items())
    )


@dataclass(frozen=True)
class ModelProfile:
    """Shape of a transformer, enough to count the FLOPs and bytes of a forward pass."""

    key: str
    hf_name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    role: str = "target"
    attention: str = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int = 0
    local_per_global: int = 0
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0
    fc_inputs: int = 0
    attention_inputs: int = 1
    bytes_per_param: int = 2
    #: The longest context SGLang serves it with (its config's max_position_embeddings, as
    #: SGLang's `get_context_length` reads it), tokens; 0: unknown, not checked.
    context_length: int = 0

    # -- parameter counts -------------------------------------------------------------------
    @property
    def attention_params_per_layer(self) -> int:
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        if self.attention == "mla":
            rope = self.qk_rope_head_dim
            q = self.hidden * self.heads * (self.head_dim + rope)
            kv_down = self.hidden * (self.kv_lora_rank + rope)
            kv_up = self.kv_lora_rank * self.heads * (self.head_dim + self.head_dim)
            return q + kv_down + kv_up + q_out * self.hidden
        inputs = self.hidden * self.attention_inputs
        return inputs * (q_out + 2 * kv_out) + q_out * self.hidden

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def fc_params(self) -> int:
        return self.fc_inputs * self.hidden * self.hidden

    @property
    def total_params(self) -> int:
        """All parameters (embeddings counted once when tied)."""
        attention = self.layers * self.attention_params_per_layer
        if self.experts:
            mlp = self.dense_layers * self.dense_mlp_params + self.moe_layers * (
                (self.experts + self.shared_experts) * self.expert_params
            )
        else:
            mlp = self.layers * self.dense_mlp_params
        head = 0 if self.tied_embeddings else self.lm_head_params
        return attention + mlp + self.embedding_params + head + self.fc_params

    @property
    def active_matmul_params(self) -> int:
        """Parameters each token multiplies through (FLOPs = 2 x this), experts as routed."""
        attention = self.layers * self.attention_params_per_layer
        if self.experts:
            mlp = self.dense_layers * self.dense_mlp_params + self.moe_layers * (
                (self.experts_per_token + self.shared_experts) * self.expert_params
            )
        else:
            mlp = self.layers * self.dense_mlp_params
        return attention + mlp + self.lm_head_params + self.fc_params

    def weight_bytes_read(self, tokens: Any) -> Any:
        """Weight bytes one forward pass over `tokens` tokens reads (embedding rows are negligible).

        Dense weights are read once whatever the token count; a MoE layer reads only the
        experts its tokens are routed to (expected count under uniform routing).
        """
        import numpy as np

        base = self.layers * self.attention_params_per_layer + self.lm_head_params
        base += self.fc_params
        if not self.experts:
            base += self.layers * self.dense_mlp_params
            return np.full_like(np.asarray(tokens, dtype=float), base * self.bytes_per_param)
        share = self.experts_per_token / self.experts
        touched = self.experts * (1.0 - (1.0 - share) ** np.asarray(tokens, dtype=float))
        per_layer = (touched + self.shared_experts) * self.expert_params
        total = base + self.dense_layers * self.dense_mlp_params + self.moe_layers * per_layer
        return total * self.bytes_per_param

    # -- attention and KV cache ----------------------------------------------------------------
    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.bytes_per_param
        return 2 * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token adds across all layers."""
        return self.layers * self.kv_bytes_per_token_per_layer

    def kv_bytes_read(self, context_tokens: Any) -> Any:
        """KV bytes one request's attention reads at a context length (windows respected)."""
        import numpy as np

        context = np.asarray(context_tokens, dtype=float)
        per_layer = self.kv_bytes_per_token_per_layer
        if self.attention == "sliding" and self.sliding_window:
            local = self.layers * self.local_per_global // (self.local_per_global + 1)
            global_layers = self.layers - local
            windowed = np.minimum(context, self.sliding_window)
            return (local * windowed + global_layers * context) * per_layer
        return self.layers * context * per_layer

    def attention_flops_per_token(self, context_tokens: Any) -> Any:
        """Score and value FLOPs for one new token attending to `context_tokens` tokens."""
        import numpy as np

        context = np.asarray(context_tokens, dtype=float)
        if self.attention == "mla":
            width = 2 * (self.kv_lora_rank + self.qk_rope_head_dim) + 2 * self.kv_lora_rank
            return self.layers * self.heads * width * context
        if self.attention == "sliding" and self.sliding_window:
            local = self.layers * self.local_per_global // (self.local_per_global + 1)
            effective = local * np.minimum(context, self.sliding_window)
            effective = effective + (self.layers - local) * context
            return 4 * self.heads * self.head_dim * effective
        return 4 * self.layers * self.heads * self.head_dim * context


@dataclass(frozen=True)
class AcceptancePrior:
    """Measured mean accept length per acceptance class at a reference depth and tree width.

    The classes are those `dvfs.twin.textprior` reads from a corpus's text. A drafter that copies
    n-grams from its context (`alpha_intercept` set) takes its per-draft probability from the
    text's repetition instead; its taus are then the calibration's targets.
    """

    family: str
    source: str
    ref_depth: int
    ref_topk: int
    tau_by_class: dict[str, float]
    alpha_intercept: float | None = None
    alpha_per_sqrt_repetition: float | None = None
    calibrated_on: tuple[str, ...] = ()

    def tau(self, acceptance_class: str) -> float:
        return self.tau_by_class[acceptance_class]


def _read(name: str) -> dict[str, Any]:
    text = resources.files("dvfs.twin").joinpath("data", name).read_text(encoding="utf-8")
    return tomllib.loads(text)


def _build(cls: type, key: str, table: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)} - {"key"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise CampaignError(f"{where}[{key}]: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(key=key, **table)
    except TypeError as exc:
        raise CampaignError(f"{where}[{key}]: {exc}") from exc


@functools.cache
def gpu_profiles() -> dict[str, GpuProfile]:
    return {k: _build(GpuProfile, k, v, "gpus.toml") for k, v in _read("gpus.toml").items()}


@functools.cache
def model_profiles() -> dict[str, ModelProfile]:
    return {k: _build(ModelProfile, k, v, "models.toml") for k, v in _read("models.toml").items()}


ACCEPTANCE_META = {
    "source",
    "ref_depth",
    "ref_topk",
    "alpha_intercept",
    "alpha_per_sqrt_repetition",
    "calibrated_on",
}


@functools.cache
def acceptance_priors() -> dict[str, AcceptancePrior]:
    from dvfs.twin.textprior import CLASSES

    priors = {}
    for family, table in _read("acceptance.toml").items():
        taus = {k: float(v) for k, v in table.items() if k not in ACCEPTANCE_META}
        if set(taus) != set(CLASSES):
            raise CampaignError(
                f"acceptance.toml[{family}]: classes {sorted(taus)}, expected {list(CLASSES)}"
            )
        intercept, slope = table.get("alpha_intercept"), table.get("alpha_per_sqrt_repetition")
        priors[family] = AcceptancePrior(
            family=family,
            source=table["source"],
            ref_depth=int(table["ref_depth"]),
            ref_topk=int(table["ref_topk"]),
            tau_by_class=taus,
            alpha_intercept=None if intercept is None else float(intercept),
            alpha_per_sqrt_repetition=None if slope is None else float(slope),
            calibrated_on=tuple(table.get("calibrated_on", ())),
        )
    return priors


@functools.cache
def published_tables() -> dict[str, dict[str, Any]]:
    """Published speculative-decoding speedups against batch size (`data/published.toml`):
    the twin's calibration and held-out targets, each table with its source and settings."""
    return _read("published.toml")


@functools.cache
def gpu_profile(key: str) -> GpuProfile:
    """A GPU profile by key; `KEY:TRAPS` picks which of NVML's measurement traps it simulates
    (all by default): `h100-sxm:none` (none), `h100-sxm:energy_steps,leakage` (only those),
    `h100-sxm:-settle,-leakage` (all but those). Trap names: `dvfs.twin.traps.TRAPS`."""
    base, _, spec = key.partition(":")
    profiles = gpu_profiles()
    if base not in profiles:
        raise CampaignError(
            f"unknown twin GPU profile {base!r}; known profiles: {', '.join(sorted(profiles))}"
        )
    # 'KEY:' (an empty list after the colon) is refused by `_with_traps`, not taken as KEY
    return _with_traps(profiles[base], spec) if ":" in key else profiles[base]


def spelled_key(profile: GpuProfile) -> str:
    """The key `gpu_profile` reads back as `profile`: a shipped GPU with some of its traps
    off is `h100-sxm:none`, `h100-sxm:leakage,settle` or `h100-sxm:-leakage`, not plain
    `h100-sxm` (a fit's base named so said the traps were on where its figures had them off);
    any other profile is its own key."""
    shipped = gpu_profiles().get(profile.key)
    if shipped is None or shipped == profile:
        return profile.key
    traps = active(profile)
    if only(shipped, *traps) != profile:
        return profile.key
    off = [t for t in TRAPS if t not in traps]
    if traps and len(off) < len(traps):  # the shorter spelling: all but these
        return f"{profile.key}:{','.join('-' + t for t in off)}"
    return f"{profile.key}:{','.join(traps) or 'none'}"


def _with_traps(profile: GpuProfile, spec: str) -> GpuProfile:
    items = [s.strip() for s in spec.split(",") if s.strip()]
    names = [s.removeprefix("-") for s in items]
    unknown = sorted(set(names) - set(TRAPS) - {"none"})
    mixed = len({s.startswith("-") for s in items}) > 1
    # "-none" names no trap to drop: refused, not read as "none" (every trap off)
    if not items or unknown or mixed or "-none" in items or ("none" in names and len(items) > 1):
        raise CampaignError(
            f"twin GPU profile {profile.key}:{spec}: after the colon name the traps to keep "
            f"(or 'none'), or those to drop as -NAME; traps: {', '.join(TRAPS)}"
        )
    if names == ["none"]:
        return without(profile)
    if items[0].startswith("-"):
        return without(profile, *names)
    return only(profile, *names)


def model_profile(key: str) -> ModelProfile:
    """A model by profile key or by its Hugging Face name (case-insensitive)."""
    profiles = model_profiles()
    if key in profiles:
        return profiles[key]
    lowered = key.lower()
    for profile in profiles.values():
        if profile.hf_name.lower() == lowered:
            return profile
    raise CampaignError(
        f"the twin has no model profile {key!r}; known: {', '.join(sorted(profiles))} "
        "(or their Hugging Face names)"
    )


def find_model_profile(key: str | None) -> ModelProfile | None:
    """Like `model_profile` but None when unknown (drafters fall back to a generic shape)."""
    if key is None:
        return None
    try:
        return model_profile(key)
    except CampaignError:
        return None


def accept_probability(tau: float, depth: int) -> float:
    """Per-draft acceptance probability a of a chain of `depth` drafts with mean length tau.

    A chain accepts draft j only if drafts 1..j were accepted, so
    tau = 1 + a + a^2 + ... + a^depth = (1 - a^(depth+1)) / (1 - a).
    """
    if depth <= 0 or tau <= 1.0:
        return 0.0
    if tau >= depth + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = depth + 1 if mid == 1.0 else (1 - mid ** (depth + 1)) / (1 - mid)
        if value < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_accept_length(alpha: float, depth: int) -> float:
    """Mean tokens per verify (bonus included) of a chain with per-draft probability alpha."""
    if depth <= 0:
        return 1.0
    if math.isclose(alpha, 1.0):
        return float(depth + 1)
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


def widen(alpha_ref: float, topk_ref: int, topk: int) -> float:
    """Per-step acceptance for another tree width (INF: the miss rate scales as topk^-1/2)."""
    miss_chain = (1 - alpha_ref) * math.sqrt(max(1, topk_ref))
    miss = miss_chain / math.sqrt(max(1, topk))
    return min(1.0, max(0.0, 1 - miss))


def matching_gpu_profile(name: str) -> GpuProfile | None:
    """The twin profile of an NVML device name (H100 SXM, H200), None for a GPU the twin has
    no profile of (an A100, an H100 PCIe, an H20, an H200 NVL, say): a profile's name must
    appear in it as whole words ("NVIDIA H20" is no "NVIDIA H200", nor "NVIDIA H100 PCIe" an
    H100 SXM), and an NVL or PCIe card is no SXM module, though its name holds the module's
    ("NVIDIA H200 NVL": 600 W at most and its own clocks, not the H200 SXM's 700 W)."""
    import re

    lowered = name.lower()
    card = re.compile(r"(?<!\w)(?:nvl|pcie)(?!\w)")
    for profile in gpu_profiles().values():
        own = profile.nvml_name.lower()
        if re.search(rf"(?<!\w){re.escape(own)}(?!\w)", lowered) and (
            card.search(own) or not card.search(lowered)
        ):
            return profile
    if card.search(lowered):
        return None
    return gpu_profile("h200-sxm") if re.search(r"(?<!\w)h200(?!\w)", lowered) else None


def profile_for_gpu_name(name: str) -> GpuProfile:
    """The twin profile matching an NVML device name, the H100 SXM's where none does: for twin
    engines on NVML and a fit's starting point, which say so where it matters."""
    return matching_gpu_profile(name) or gpu_profile("h100-sxm")


def recorded_gpu_profile(attrs: Mapping[str, object]) -> GpuProfile | None:
    """The twin profile of the GPU a cube (or roofline file) was measured on, from its
    attributes: a twin's own (`twin_profile`, a trap list after a colon included) where the
    twin measured it, else the one its `gpu_name` matches (`matching_gpu_profile`); None for
    a GPU the twin has no profile of. A real GPU's `twin_profile` is a hardware campaign's
    `gpu.profile`, the twin that estimated its time, not its model (an H200 swept with
    `gpu.profile = "h100-sxm"`); a profile lent from a file to `twin predict` and no longer
    known is matched by the GPU's name (its twin's, which the fit kept). A twin GPU named as
    another shipped profile's twin is that profile's, with the recorded trap list: a fleet
    mixing twin models (`--gpus 0,h200-sxm:0`) wrote each model's cube under the campaign's
    `gpu.profile` before dvfs recorded the profile its GPUs ran (`_twin_profile_run`)."""
    name = str(attrs.get("gpu_name") or "")
    key = str(attrs.get("twin_profile") or "")
    if key and (attrs.get("gpu_backend") == "twin" or name.endswith(" (twin)")):
        base, sep, traps = key.partition(":")
        profiles = gpu_profiles()
        if base in profiles and name != f"{profiles[base].nvml_name} (twin)":
            ran = [k for k, p in profiles.items() if name == f"{p.nvml_name} (twin)"]
            key = ran[0] + sep + traps if ran else key
        try:
            return gpu_profile(key)
        except CampaignError:
            pass
    return matching_gpu_profile(name.removesuffix(" (twin)"))
