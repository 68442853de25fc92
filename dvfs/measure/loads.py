"""Steady loads for timing a knob change without a server (`dvfs gpu settle --load`).

Each is a callable that keeps every GPU busy for a short burst (tens of milliseconds) and
returns, so `dvfs.measure.settle.measure_settle` can sample between bursts: on the twin a
burst of large GEMM passes started at the knobs then in force; on real GPUs a large GEMM in
torch, captured in a CUDA graph and replayed on each GPU's own CUDA device (found by UUID,
since CUDA and NVML may number GPUs differently).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dvfs.errors import CampaignError
from dvfs.gpu.base import Gpu

#: One GEMM of the load: a square bf16 matmul of this size (~1 ms on an H100 at full clock).
GEMM_SIZE = 8192

#: Roughly how long one burst keeps the GPUs busy.
BURST_S = 0.05


def twin_gemm_load(gpus: Sequence[Any], passes: int = 100) -> Callable[[], None]:
    """Bursts of `passes` large GEMMs on twin GPUs (`dvfs.gpu.twin.TwinGpu`), all in lock-step
    on their shared virtual clock: about 50 ms a burst at the top clock."""
    import numpy as np

    from dvfs.twin.device import TwinNode
    from dvfs.twin.physics import Passes

    node = TwinNode([g.device for g in gpus])
    one = np.ones(passes)
    flops = 2.0 * 4096 * 4096 * 14336
    gemm = Passes(flops * one, 3.0e8 * one, 0 * one, 0 * one, 0 * one)

    def load() -> None:
        schedule = node.execute(gemm)
        node.clock.sleep(int(schedule.ends_ns[-1]) / 1e9)

    return load


def cuda_devices(gpus: Sequence[Gpu], torch: Any) -> list[str]:
    """The torch device ("cuda:N") of each NVML GPU, matched by UUID."""
    from dvfs.roofline.kernels import BenchSpec, cuda_uuid

    by_uuid = {}
    for i in range(torch.cuda.device_count()):
        spec = BenchSpec(f"cuda:{i}", "bfloat16", 1, 1, (1,), 1)
        uuid = cuda_uuid(spec, torch)
        if uuid is not None:
            by_uuid[uuid] = spec.device
    missing = [g.identity.uuid for g in gpus if g.identity.uuid not in by_uuid]
    if missing:
        raise CampaignError(
            f"torch sees no CUDA device for {', '.join(missing)} (CUDA_VISIBLE_DEVICES?): "
            "the load must run on the GPU being timed"
        )
    return [by_uuid[g.identity.uuid] for g in gpus]


def torch_gemm_load(
    gpus: Sequence[Gpu], device: str = "cuda", size: int = GEMM_SIZE
) -> Callable[[], None]:
    """Bursts of large GEMMs in torch on each GPU's CUDA device (`device="cuda"`), or all on
    `device` when it names one ("cpu" runs small ones on the CPU: the path, for tests)."""
    from dvfs.roofline.kernels import BenchSpec, Kernel, check_device, import_torch, prepare

    torch = import_torch("`dvfs gpu settle --load`")
    if device == "cuda":  # a torch without CUDA: said as such, naming this command's option
        check_device(BenchSpec(device, "bfloat16", 1, 1, (1,), 1), torch, "--load-device")
    devices = cuda_devices(gpus, torch) if device == "cuda" else [device]
    dtype = "bfloat16" if device != "cpu" else "float32"
    n = size if device != "cpu" else 128
    kernel = Kernel("load", "gemm", n, n, n, 2.0 * n**3, 0.0)
    runs = []
    for name in devices:
        spec = BenchSpec(name, dtype, n, n, (n,), 1, warmup=2)
        check_device(spec, torch, "--load-device")
        if spec.on_cuda:
            with torch.cuda.device(torch.device(spec.device)):  # its streams and graph there
                runs.append((spec, prepare(kernel, spec, torch)))
        else:
            runs.append((spec, prepare(kernel, spec, torch)))

    def load() -> None:
        import time

        start = time.perf_counter()
        while time.perf_counter() - start < BURST_S:  # a few ms of work queued at a time
            for _, prepared in runs:
                prepared.launch()
            for spec, _ in runs:
                if spec.on_cuda:
                    torch.cuda.synchronize(torch.device(spec.device))

    return load
