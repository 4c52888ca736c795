"""What a rank's memory held when it ran out, worked out in the rank while it still can (its
excepthook, before the process goes): the size asked, the device's total, free and
allocated/reserved memory, other processes' share, and the allocated memory split into
parameters, gradients, optimizer state and the rest (activations, workspaces), found from the
modules and optimizers alive in the process; the batch size in use and the world's size, so
the launcher can compute fixes. For a CUDA OOM (`torch.OutOfMemoryError`) and the CPU
allocator's failure ("DefaultCPUAllocator: can't allocate memory").

The facts go to the rank's state file `protocol.MEMORY` (JSON); `ddpkit.launch.oom_verdict` turns
them into the verdict and its fixes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import runtime

_ASKED = re.compile(r"(?:Tried to allocate|tried to allocate) ([\d.]+) ?(bytes|[KMGT]i?B)")
_ALLOWED = re.compile(r"([\d.]+) ?(bytes|[KMGT]i?B) allowed")
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}  # fmt: skip


HOST_OOM_WORDS = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "MemoryError",  # raised in an autograd or DDP callback and wrapped in a RuntimeError
    "std::bad_alloc",
)


def is_out_of_memory(error: BaseException) -> str | None:
    """'cuda' or 'cpu' for an allocator's failure, else None."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    message = str(error)
    if (oom_type is not None and isinstance(error, oom_type)) or "CUDA out of memory" in message:
        return "cuda"
    if isinstance(error, RuntimeError | MemoryError) and any(
        words in message for words in HOST_OOM_WORDS
    ):
        return "cpu"  # the CPU allocator's own words, or a MemoryError torch wrapped
    if isinstance(error, MemoryError):
        return "cpu"
    return None


def asked_bytes(message: str) -> int | None:
    found = _ASKED.search(message)
    if not found:
        return None
    return int(float(found.group(1)) * _UNITS.get(found.group(2), 1))


def allowed_bytes(message: str, total: int | None) -> int | None:
    """The process's ceiling where one was set (torch.cuda.set_per_process_memory_fraction):
    torch's message says "N GiB allowed"; newer torch also tells the fraction."""
    found = _ALLOWED.search(message)
    if found:
        return int(float(found.group(1)) * _UNITS.get(found.group(2), 1))
    torch = sys.modules.get("torch")
    get = getattr(getattr(torch, "cuda", None), "get_per_process_memory_fraction", None)
    if get is None or not total:
        return None
    try:
        fraction = float(get())
    except Exception:
        return None
    return int(total * fraction) if 0 < fraction < 1 else None


def facts(error: BaseException, kind: str) -> protocol.OomFacts:
    """The rank's memory as it ran out (every figure in bytes), read at the failure."""
    import torch

    from ddpkit.rank import memory_model

    out: protocol.OomFacts = {"kind": kind, "asked": asked_bytes(str(error))}
    out["world_size"] = int(os.environ.get("WORLD_SIZE", "1") or 1)
    device = _device(kind)
    modules, optimizers = memory_model.live_objects()
    out.update(memory_model.held(device, modules, optimizers))
    out["blocks"] = memory_model.blocks(modules)
    phase, batch = memory_model.failing_step(error.__traceback__)
    out["phase"] = phase
    # the failing forward's own inputs say its batch; else the DataLoader in use
    out["batch"], out["batch_from"] = (
        (batch, "forward")
        if batch
        else (
            memory_model.loader_batch(),
            "loader",
        )
    )
    grew = growth_before()
    if grew is not None:
        out["grew"] = grew
    if kind == "cuda" and device is not None and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        out["device"] = index
        with contextlib.suppress(Exception):  # a broken context: the other figures still
            free, total = torch.cuda.mem_get_info(index)
            out["free"], out["total"] = int(free), int(total)
        out["allocated"] = int(torch.cuda.memory_allocated(index))
        out["reserved"] = int(torch.cuda.memory_reserved(index))
        allowed = allowed_bytes(str(error), out.get("total"))
        if allowed is not None:  # set_per_process_memory_fraction: the process's own ceiling
            out["allowed"] = allowed
            out["free"] = max(0, min(int(out.get("free") or allowed), allowed - out["reserved"]))
        out["peak_allocated"] = int(torch.cuda.max_memory_allocated(index))
        out["others"] = _other_processes(index)
    else:
        import psutil

        from ddpkit.common.host_memory import host_room

        rss = psutil.Process().memory_info().rss
        out["allocated"] = out["reserved"] = int(rss)
        room = host_room()  # the machine, the memory cgroup or ulimit -v, as it is now
        free = room.free
        released = runtime.current().part(Reserve).released
        if released and room.kind == "address_space":  # the reserve's space was not free then
            free = max(0, free - RESERVE_BYTES)
        out["free"], out["total"], out["bound"] = free, room.total, room.bound
        out["bound_kind"] = room.kind
        out["others"] = None
    return out


RESERVE_BYTES = 64 * 2**20


@dataclass
class Reserve:
    """Address space held for the failure's own needs: a part of the rank's runtime."""

    mapped: Any = None
    released: bool = False  # given back at the failure: not part of what was free


def reserve() -> None:
    """Map (not touch) RESERVE_BYTES of address space, given back when the rank runs out of
    memory, so that what the failure needs (the scan below, the traceback, the error file)
    still fits under an address-space limit (`ulimit -v`). Untouched pages take no RAM."""
    import mmap

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    with contextlib.suppress(Exception):
        runtime.current().part(Reserve).mapped = mmap.mmap(-1, RESERVE_BYTES, flags=flags)


def release_reserve() -> None:
    held = runtime.current().part(Reserve)
    if held.mapped is not None:
        with contextlib.suppress(Exception):
            held.mapped.close()
        held.mapped, held.released = None, True


GREW_MIN_BYTES = 64 * 2**20  # growth below this before a failure is no leak
GREW_MIN_SAMPLES = 4


def growth_before() -> list[int] | None:
    """[first step, last step, bytes then, bytes at the last] when the GPU memory torch held at
    the end of each step read grew at every read (a leak: something kept every step) by at
    least GREW_MIN_BYTES; None otherwise (memory that stayed level, or too few steps)."""
    from ddpkit.rank import steps

    clock = steps.clock()
    series = list(clock.memory_series) if clock is not None else []
    if len(series) < GREW_MIN_SAMPLES:
        return None
    values = [held for _, held in series]
    rising = all(b > a for a, b in zip(values, values[1:], strict=False))
    if not rising or values[-1] - values[0] < GREW_MIN_BYTES:
        return None
    return [series[0][0], series[-1][0], values[0], values[-1]]


def write(state_dir: str, rank: str, error: BaseException) -> None:
    """The facts of an out-of-memory error, when `error` is one (never raises)."""
    try:
        kind = is_out_of_memory(error)
        if kind is None or not state_dir:
            return
        found = facts(error, kind)
        protocol.state_path(state_dir, rank, protocol.MEMORY).write_text(json.dumps(found))
        if kind == "cuda":
            dump_history(state_dir, rank)
    except Exception:  # the verdict goes without its figures rather than hiding the error
        pass


def _device(kind: str) -> Any:
    import torch

    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _other_processes(index: int) -> int | None:
    """Bytes other processes use on this GPU (NVML), or None without NVML."""
    try:
        from ddpkit.common.gpus import nvml

        with nvml() as nv:
            if nv is None:
                return None
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            mine = os.getpid()
            return sum(
                int(proc.usedGpuMemory)
                for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle)
                if proc.pid != mine and proc.usedGpuMemory
            )
    except Exception:
        return None


def start_history() -> None:
    """Record the allocator's events (bounded), where the launcher asked and a GPU is used."""
    entries = os.environ.get(protocol.MEMORY_HISTORY, "")
    torch = sys.modules.get("torch")
    if not entries.isdigit() or torch is None or not torch.cuda.is_available():
        return
    # Python stacks only: torch's default also unwinds the C++ stack of every allocation,
    # which cost a GPT-2-small step 21% on an H200 (benchmarks/memory_watch_cost.py)
    with contextlib.suppress(Exception):  # an old torch: the verdict goes without a snapshot
        torch.cuda.memory._record_memory_history(max_entries=int(entries), stacks="python")


def dump_history(state_dir: str, rank: str) -> None:
    """The snapshot (torch's pickle, which pytorch.org/memory_viz opens) and a plot of the
    allocated memory over the recorded events, into the rank's state files."""
    torch = sys.modules.get("torch")
    if not os.environ.get(protocol.MEMORY_HISTORY) or torch is None:
        return
    with contextlib.suppress(Exception):
        path = protocol.state_path(state_dir, rank, protocol.MEMORY_SNAPSHOT)
        torch.cuda.memory._dump_snapshot(str(path))
        snapshot = torch.cuda.memory._snapshot()
        plot_history(snapshot, int(torch.cuda.memory_allocated()), state_dir, rank)


def plot_history(snapshot: dict[str, Any], allocated: int, state_dir: str, rank: str) -> None:
    """Allocated bytes over the recorded events (ending at what is allocated now)."""
    traces = snapshot.get("device_traces") or []
    events = max(traces, key=len) if traces else []
    deltas = []
    for event in events:
        action = event.get("action")
        if action == "alloc":
            deltas.append(int(event.get("size", 0)))
        elif action == "free_completed":
            deltas.append(-int(event.get("size", 0)))
    if not deltas:
        return
    running, total = [], 0
    for d in deltas:
        total += d
        running.append(total)
    offset = allocated - running[-1]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([(v + offset) / 2**30 for v in running], lw=0.8)
    ax.set_xlabel(f"allocator events (the last {len(running)})")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(f"rank {rank}: GPU memory before it ran out")
    fig.tight_layout()
    fig.savefig(protocol.state_path(state_dir, rank, protocol.MEMORY_PLOT), dpi=100)
    plt.close(fig)
