"""How many GPUs this process may use, found without importing torch (the launcher and
`ddpkit --help` must start fast): NVML when installed, else the driver's /proc entries,
filtered by CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
from pathlib import Path


def physical_gpu_count() -> int:
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        proc = Path("/proc/driver/nvidia/gpus")
        return len(list(proc.iterdir())) if proc.is_dir() else 0


def visible_gpu_count(environ: dict[str, str] | None = None) -> int:
    """GPUs left visible by CUDA_VISIBLE_DEVICES (CUDA stops at the first invalid entry)."""
    env = os.environ if environ is None else environ
    physical = physical_gpu_count()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or (entry.lstrip("-").isdigit() and not 0 <= int(entry) < physical):
            break
        count += 1
    return min(count, physical)
