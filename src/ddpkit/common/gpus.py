"""How many GPUs this process may use, found without importing torch (the launcher and
`ddpkit --help` must start fast): NVML when installed, else the driver's /proc entries,
filtered by CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpkit.errors import debug_note


@contextlib.contextmanager
def nvml() -> Iterator[Any]:
    """pynvml, initialised for the block and shut down after it; None without NVML (not
    installed, no driver). Errors inside the block are the caller's."""
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
    except Exception as err:
        debug_note("nvml", err)
        yield None
        return
    try:
        yield pynvml
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def physical_gpu_count() -> int:
    with nvml() as pynvml:
        if pynvml is not None:
            with contextlib.suppress(Exception):
                return int(pynvml.nvmlDeviceGetCount())
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


def utilization(uuid: str) -> tuple[int, int] | None:
    """(the GPU's index, the percent of the last sample period a kernel ran on it) for the
    GPU with this UUID (torch's form, without NVML's 'GPU-' prefix, is taken too); None
    without NVML or no such GPU."""
    name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    with nvml() as pynvml:
        if pynvml is None:
            return None
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(name)
            index = int(pynvml.nvmlDeviceGetIndex(handle))
            return index, int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception as err:
            debug_note("nvml utilization", err)
            return None


# NVML's NVLink version enum -> (generation, one-way GB/s per link); GB/s per PCIe lane.
NVLINK = {
    1: ("1", 20.0),
    2: ("2", 25.0),
    3: ("2.2", 25.0),
    4: ("3", 25.0),
    5: ("3.1", 25.0),
    6: ("4", 25.0),
    7: ("5", 50.0),
}
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def link_peak(index: int) -> dict[str, object] | None:
    """The one-way peak of GPU `index`'s links to its peers, from NVML: active NVLinks times
    the per-link rate of their version, else its PCIe link. None without NVML."""
    with nvml() as pynvml:
        if pynvml is None:
            return None
        try:
            return _peak(pynvml, index)
        except Exception as err:
            debug_note("nvml link peak", err)
            return None


def _peak(pynvml: Any, index: int) -> dict[str, object]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    links, version = 0, 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                links += 1
                version = max(version, pynvml.nvmlDeviceGetNvLinkVersion(handle, link))
        except pynvml.NVMLError:
            break
    if links:
        generation, per_link = NVLINK.get(version, (f"?{version}", 25.0))
        return {"gbps": links * per_link, "link": f"NVLink{generation} x{links}"}
    gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
    width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
    gbps = round(PCIE_LANE_GBPS.get(gen, 1.0) * width, 1)
    return {"gbps": gbps, "link": f"PCIe gen{gen} x{width}"}
