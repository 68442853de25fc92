"""The roofline's microbenchmarks in torch: GEMMs over token counts, a bandwidth triad and copy,
and the decode-shaped GEMV, each timed after warm-up.

On CUDA a kernel is captured `calls_per_launch` times into one CUDA graph, so launch overhead
does not hide the small-M GEMMs, and timed with CUDA events; on the CPU (`--device cpu`, for CI
and laptops) the same kernels run on CPU tensors timed with `perf_counter`. torch is an optional
extra: `import_torch` imports it lazily and says in one line how to install it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dvfs.errors import DvfsError

INSTALL_HINT = "pip install 'dvfs[torch]'"


class TorchMissingError(DvfsError):
    """torch is not installed: the roofline needs the optional extra."""


class DeviceError(DvfsError):
    """The torch device asked for cannot run the benchmarks."""

    exit_code = 2


def import_torch(command: str = "`dvfs gpu roofline`") -> Any:
    """torch, or one line saying how to install it, naming the `command` that needs it (dvfs
    itself never needs it)."""
    try:
        import torch
    except ImportError:
        raise TorchMissingError(
            f"{command} needs torch, an optional extra: {INSTALL_HINT} (or pip install torch)"
        ) from None
    return torch


@dataclass(frozen=True)
class Kernel:
    """One benchmark: C = A(m x k) @ B(k x n) for GEMMs, n elements per array for bandwidth."""

    name: str
    kind: str  # "gemm", "gemv" or "bandwidth"
    m: int
    n: int
    k: int
    flops: float
    bytes: float


@dataclass(frozen=True)
class BenchSpec:
    """What to run and on which torch device; sizes come from a model's hidden and MLP widths."""

    device: str
    dtype: str
    hidden: int
    intermediate: int
    tokens: tuple[int, ...]
    bandwidth_elements: int
    min_time_s: float = 0.1
    warmup: int = 3
    #: CPU threads: one by default, so a busy CI machine's oversubscribed cores do not turn the
    #: CPU path's timings into noise (it tests the path; it is not a CPU benchmark).
    cpu_threads: int = 1

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def element_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def plan_kernels(spec: BenchSpec) -> list[Kernel]:
    """The kernels of one roofline point: up/down GEMMs per M, the GEMVs, triad and copy.

    Bytes are the minimum traffic (each operand read once, the result written once), so
    bytes/s is a lower bound on what the memory system moved.
    """
    e = element_bytes(spec.dtype)
    shapes = {"up": (spec.intermediate, spec.hidden), "down": (spec.hidden, spec.intermediate)}
    kernels = []
    for label, (n, k) in shapes.items():
        for m in sorted(set(spec.tokens)):
            kernels.append(
                Kernel(
                    f"gemm-{label}-m{m}",
                    "gemm",
                    m,
                    n,
                    k,
                    2.0 * m * n * k,
                    e * (m * k + k * n + m * n),
                )
            )
    for label, (n, k) in shapes.items():
        kernels.append(Kernel(f"gemv-{label}", "gemv", 1, n, k, 2.0 * n * k, e * (k + k * n + n)))
    size = spec.bandwidth_elements
    kernels.append(Kernel("triad", "bandwidth", 0, size, 0, 2.0 * size, 3.0 * e * size))
    kernels.append(Kernel("copy", "bandwidth", 0, size, 0, 0.0, 2.0 * e * size))
    return kernels


@dataclass
class Prepared:
    """A kernel ready to run: `launch()` issues `calls_per_launch` calls (one graph replay on
    CUDA); `sync()` waits for them. `operation` keeps the tensors a captured graph reads and
    writes alive: freed, their memory would be reused under the graph."""

    kernel: Kernel
    launch: Callable[[], None]
    sync: Callable[[], None]
    calls_per_launch: int
    operation: Callable[[], None] | None = None


def _operation(
    kernel: Kernel, spec: BenchSpec, torch: Any, weights: dict[tuple[int, int], Any]
) -> Callable[[], None]:
    """The kernel's call, on tensors allocated once (results written in place: graph-safe).
    GEMMs and GEMVs of one shape share their weight (`weights`), as a model's layers do not
    but one layer's passes at every batch size do."""
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator(device=spec.device).manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device=spec.device, dtype=dtype)

    if kernel.kind in ("gemm", "gemv"):
        key = (kernel.k, kernel.n)
        if key not in weights:
            weights[key] = rand(kernel.k, kernel.n)
        w = weights[key]
    if kernel.kind == "gemm":
        a = rand(kernel.m, kernel.k)
        c = torch.empty(kernel.m, kernel.n, device=spec.device, dtype=dtype)
        return lambda: torch.matmul(a, w, out=c)
    if kernel.kind == "gemv":
        wt, x = w.t(), rand(kernel.k)  # y = W^T x reads the same (k x n) weight
        y = torch.empty(kernel.n, device=spec.device, dtype=dtype)
        return lambda: torch.mv(wt, x, out=y)
    x = rand(kernel.n)
    z = torch.empty(kernel.n, device=spec.device, dtype=dtype)
    if kernel.name == "triad":
        y = rand(kernel.n)
        return lambda: torch.add(x, y, alpha=0.5, out=z)
    return lambda: z.copy_(x)


def prepare(
    kernel: Kernel, spec: BenchSpec, torch: Any, weights: dict[tuple[int, int], Any] | None = None
) -> Prepared:
    """Allocate, warm up, and on CUDA capture enough calls in one graph to last ~2 ms."""
    op = _operation(kernel, spec, torch, {} if weights is None else weights)
    for _ in range(spec.warmup):
        op()
    if not spec.on_cuda:
        return Prepared(kernel, op, lambda: None, 1, op)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        op()
    end.record()
    end.synchronize()
    per_call_s = max(start.elapsed_time(end) / 1e3 / 10, 1e-7)
    calls = max(1, min(256, math.ceil(2e-3 / per_call_s)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture requires
        for _ in range(2):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            op()
    graph.replay()
    torch.cuda.synchronize()
    return Prepared(kernel, graph.replay, torch.cuda.synchronize, calls, op)


def time_per_call(prepared: Prepared, spec: BenchSpec, torch: Any) -> float:
    """Seconds per call: launches repeated until `min_time_s` has passed (CUDA events on a GPU,
    perf_counter on the CPU)."""
    launches = 0
    if spec.on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        prepared.sync()
        start.record()
        t0 = time.perf_counter()
        while launches == 0 or time.perf_counter() - t0 < spec.min_time_s:
            prepared.launch()
            launches += 1
            if launches % 16 == 0:
                end.record()
                end.synchronize()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        while launches == 0 or time.perf_counter() - t0 < spec.min_time_s:
            prepared.launch()
            launches += 1
        elapsed = time.perf_counter() - t0
    return elapsed / (launches * prepared.calls_per_launch)


def device_name(spec: BenchSpec, torch: Any) -> str:
    """What ran the kernels, for the output (the GPU's name, or the CPU's)."""
    if spec.on_cuda:
        return str(torch.cuda.get_device_name(torch.device(spec.device)))
    import platform

    threads = torch.get_num_threads()
    return (
        f"CPU ({platform.processor() or platform.machine()}, {threads} thread{'s' * (threads > 1)})"
    )


def check_device(spec: BenchSpec, torch: Any, option: str = "--device") -> None:
    """Refuse a CUDA device torch cannot see, in one line naming --twin and `option` cpu (the
    command's option that chose the device); on the CPU, set the thread count."""
    if not spec.on_cuda:
        torch.set_num_threads(spec.cpu_threads)
    if spec.on_cuda and not torch.cuda.is_available():
        raise DeviceError(
            f"torch {torch.__version__} sees no CUDA device for {option} {spec.device}: "
            "install a CUDA build of torch on a GPU machine, or simulate the twin's GPU with "
            f"--twin h100-sxm (or h200-sxm); {option} cpu only runs the code path on CPU "
            "tensors (tiny sizes, no energy)"
        )


def cuda_uuid(spec: BenchSpec, torch: Any) -> str | None:
    """The NVML UUID of the CUDA device (CUDA and NVML may number GPUs differently)."""
    try:
        uuid = torch.cuda.get_device_properties(torch.device(spec.device)).uuid
    except (AttributeError, RuntimeError):
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"
