"""The host memory a process may use, read where the kernel keeps it: its memory cgroup (v2
unified, or v1's memory controller: the limit, what the group uses, the OOM killer's count)
and its address-space limit (RLIMIT_AS, `ulimit -v`). Nothing here imports torch."""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass
from pathlib import Path


def memory_cgroup(pid: int | str = "self") -> Path | None:
    """The folder of a process's memory cgroup (v2 unified, or v1's memory controller)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") or [""]:
                paths[controller] = parts[2]
    for mount in mounts:
        fields = mount.split()
        if " - " not in mount or len(fields) < 5:
            continue
        root, point = fields[3], fields[4]
        kind, _, options = mount.split(" - ", 1)[1].partition(" ")
        if kind.startswith("cgroup2") and "" in paths:
            inner = paths[""]
        elif (
            kind.startswith("cgroup")
            and "memory" in options.split()[-1].split(",")
            and "memory" in paths
        ):
            inner = paths["memory"]
        else:
            continue
        relative = os.path.relpath(inner, root) if inner.startswith(root) else inner.lstrip("/")
        folder = Path(point) / relative
        if (folder / "memory.events").exists() or (folder / "memory.oom_control").exists():
            return folder.resolve()
    return None


def oom_kills(folder: Path | None) -> int:
    """How many processes the OOM killer has ended in this memory cgroup (and below it)."""
    if folder is None:
        return 0
    for name in ("memory.events", "memory.oom_control"):
        with contextlib.suppress(OSError, ValueError):
            for line in (folder / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


def memory_limit(folder: Path | None) -> int | None:
    if folder is None:
        return None
    for name in ("memory.max", "memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = (folder / name).read_text().strip()
            if text != "max" and int(text) < 1 << 60:
                return int(text)
    return None


def cgroup_usage(folder: Path | None) -> int | None:
    if folder is None:
        return None
    for name in ("memory.current", "memory.usage_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            return int((folder / name).read_text().strip())
    return None


def address_space() -> tuple[int, int] | None:
    """(the limit, the bytes of address space this process has mapped) when RLIMIT_AS is
    set (`ulimit -v`), else None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                used = int(line.split()[1]) * 1024
    return int(soft), used


@dataclass(frozen=True)
class HostRoom:
    """What bounds this process's host memory, at the moment it is read."""

    total: int  # bytes the bound allows in all
    free: int  # bytes left under it
    bound: str  # 'the machine', 'the memory cgroup (SLURM's --mem, ...)', 'RLIMIT_AS ...'
    kind: str = "machine"  # what bounds it: "machine", "cgroup" or "address_space"


def host_room() -> HostRoom:
    """The tightest bound on this process's host memory: the address-space limit, the memory
    cgroup's limit, or the machine's memory."""
    import psutil

    vm = psutil.virtual_memory()
    rooms = [HostRoom(int(vm.total), int(vm.available), "the machine", "machine")]
    folder = memory_cgroup()
    limit, usage = memory_limit(folder), cgroup_usage(folder)
    if limit is not None and usage is not None and limit < vm.total:
        rooms.append(
            HostRoom(
                limit,
                max(0, limit - usage),
                "the memory cgroup's limit (SLURM's --mem, a pod's)",
                "cgroup",
            )
        )
    space = address_space()
    if space is not None:
        rooms.append(
            HostRoom(
                space[0],
                max(0, space[0] - space[1]),
                "the address-space limit (RLIMIT_AS: ulimit -v)",
                "address_space",
            )
        )
    return min(rooms, key=lambda r: r.free)
