"""How much of a training step the GPU spends computing, from torch.profiler: the union of
kernel (and copy) intervals per step, NCCL's left out (an NCCL kernel may only be waiting for a
peer). Set against the step's unprofiled wall time it tells a GPU-bound step (near 1) from one
whose pace the host sets, where a synchronous multi-GPU step also waits for the slowest rank's
host every time. The profiler slows the host, never the kernels, so kernel time stays true
while profiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# The profiler also puts user annotations on the GPU timeline; these are not kernels.
ANNOTATIONS = ("nccl:", "Optimizer.", "ProfilerStep", "DistributedDataParallel")


def is_kernel(event: Any) -> bool:
    if event.device_type != torch.autograd.DeviceType.CUDA or not event.time_range:
        return False
    return not any(a in event.name for a in ANNOTATIONS)


def union_us(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def compute_seconds_per_step(step: Callable[[], None], repeats: int = 3) -> float:
    """Seconds per step during which some kernel other than NCCL's runs on the GPU (an NCCL
    kernel may only be waiting for a peer). `step` must run on a CUDA device."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if is_kernel(e) and "nccl" not in e.name.lower()
    ]
    return union_us(spans) / repeats / 1e6
