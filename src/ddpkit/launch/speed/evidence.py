"""The facts a straggler verdict gives as evidence: each GPU's clocks, throttle reasons,
temperature, power, utilisation, memory and other processes (NVML), and the host's CPU load,
steal and memory, and a rank's own share of a core (psutil). Read by the launcher every few
seconds; nothing here imports torch, and every fact is optional (no NVML: no GPU facts)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, TypedDict, cast

import psutil

from ddpkit.common import procs
from ddpkit.errors import debug_note

# NVML's clock-event (throttle) reason bits that slow a GPU down, and what to call them
THROTTLES = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "power brake",
}


class OtherProcess(TypedDict):
    """A process of another job on a rank's GPU."""

    pid: int
    name: str
    mib: int  # GPU memory it holds


class GpuFacts(TypedDict, total=False):
    """What NVML says of a rank's GPU; any fact may be missing."""

    index: int
    sm_mhz: int
    max_sm_mhz: int
    temp_c: int
    power_w: float
    power_limit_w: float
    util: int
    mem_used_mib: int
    mem_total_mib: int
    throttle: list[str]  # THROTTLES' names
    other_processes: list[OtherProcess]


class HostFacts(TypedDict, total=False):
    """The host's CPU and memory, as psutil reads them."""

    cores: int
    cpu_percent: float
    load1: float
    steal_percent: float
    mem_percent: float


class Competitor(TypedDict):
    """A process outside the job busy on a rank's cores."""

    pid: int
    name: str
    percent: float  # of a core, the part that can fall on the rank's cores


class RankFacts(TypedDict, total=False):
    """The evidence beside a rank's step times (also sent between nodes as JSON)."""

    host: HostFacts
    cpu_share: float  # cores the rank's process tree used
    cpu_demand: float  # cores it ran or waited to run on
    cpu_queued: float  # cores' worth of time its threads, all of them, waited in the run queue
    gpu: GpuFacts
    competitors: list[Competitor]


class Gpus:
    """NVML, initialised once for the job; facts about a GPU by its UUID."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.handles: dict[str, Any] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception as err:
            debug_note("nvml", err)

    def close(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
            self.nvml = None

    def _handle(self, uuid: str) -> Any:
        if uuid not in self.handles:
            name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            self.handles[uuid] = self.nvml.nvmlDeviceGetHandleByUUID(name)
        return self.handles[uuid]

    def facts(self, uuid: str, job_pids: AbstractSet[int] = frozenset()) -> GpuFacts:
        """What NVML says of the GPU now ({} without NVML or for an unknown UUID)."""
        if self.nvml is None or not uuid:
            return {}
        nv = self.nvml
        out: dict[str, object] = {}
        try:
            h = self._handle(uuid)
            out["index"] = int(nv.nvmlDeviceGetIndex(h))
        except Exception as err:
            debug_note("nvml handle", err)
            return {}
        reads: dict[str, Callable[[], object]] = {
            "sm_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "max_sm_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "temp_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "power_limit_w": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "util": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "mem_used_mib": lambda: nv.nvmlDeviceGetMemoryInfo(h).used // 2**20,
            "mem_total_mib": lambda: nv.nvmlDeviceGetMemoryInfo(h).total // 2**20,
        }
        for key, read in reads.items():
            with contextlib.suppress(Exception):
                out[key] = read()
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        with contextlib.suppress(Exception):
            assert reasons is not None
            bits = int(reasons(h))
            out["throttle"] = [name for bit, name in THROTTLES.items() if bits & bit]
        with contextlib.suppress(Exception):
            others: list[OtherProcess] = []
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in job_pids:
                    continue
                mib = (p.usedGpuMemory or 0) // 2**20
                others.append({"pid": p.pid, "name": _name(p.pid), "mib": mib})
            out["other_processes"] = others
        return cast(GpuFacts, out)  # the keys read above, each only when NVML answered


def _name(pid: int) -> str:
    try:
        words = psutil.Process(pid).cmdline()
        text = " ".join(" ".join(words).split())  # one line, whatever the arguments hold
        return text[:60] if text else psutil.Process(pid).name()
    except psutil.Error:
        return "?"


class Host:
    """This machine's CPU and memory, and each rank's share of a core, between two reads."""

    def __init__(self) -> None:
        psutil.cpu_percent()
        with contextlib.suppress(Exception):
            psutil.cpu_times_percent()
        self._cpu: dict[int, tuple[float, float]] = {}  # pid -> (cpu seconds, when)
        self._demand: dict[int, tuple[float, float]] = {}  # pid -> (run + queued s, when)
        self._queued: dict[int, tuple[float, float]] = {}  # pid -> (all threads' queued s, when)

    def facts(self) -> HostFacts:
        out: HostFacts = {"cores": psutil.cpu_count() or 1}
        with contextlib.suppress(Exception):
            out["cpu_percent"] = psutil.cpu_percent()
        with contextlib.suppress(Exception):
            out["load1"] = os.getloadavg()[0]
        with contextlib.suppress(Exception):
            out["steal_percent"] = getattr(psutil.cpu_times_percent(), "steal", 0.0)
        with contextlib.suppress(Exception):
            out["mem_percent"] = psutil.virtual_memory().percent
        return out

    def cpu_share(self, pid: int) -> float | None:
        """Cores the rank's process tree used since the last call (1.0 = one whole core)."""
        used = 0.0
        try:
            for proc in procs.tree(pid):
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    used += t.user + t.system
        except psutil.Error:
            return None
        now = time.monotonic()
        before = self._cpu.get(pid)
        self._cpu[pid] = (used, now)
        if before is None or now <= before[1]:
            return None
        return (used - before[0]) / (now - before[1])

    def cpu_demand(self, pid: int) -> float | None:
        """Cores the rank's main thread (the one running the script) ran on or waited in the
        run queue for, since the last call (the kernel's schedstat): what it would have used
        with a core to itself. Low demand is a thread that sleeps or blocks; high demand and
        a low share, one starved of CPU. The rank's other threads (gloo's, ddpkit's own, a
        spinning OpenMP pool) are left out: they are not the script's work."""
        try:
            with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
                run, queued, _ = f.read().split()
        except (OSError, ValueError):
            return None
        total = (int(run) + int(queued)) / 1e9
        now = time.monotonic()
        before = self._demand.get(pid)
        self._demand[pid] = (total, now)
        if before is None or now <= before[1]:
            return None
        return max(0.0, (total - before[0]) / (now - before[1]))

    def cpu_queued(self, pid: int) -> float | None:
        """Cores' worth of time every thread of the rank waited in the run queue since the last
        call: a main thread blocked on its own threads (gloo's, doing its all-reduce) asks for
        little while those threads are starved; a rank that sleeps queues for nothing."""
        total = 0
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"/proc/{pid}/task/{task}/schedstat") as f,
                ):
                    total += int(f.read().split()[1])
        except OSError:
            return None
        now = time.monotonic()
        before = self._queued.get(pid)
        self._queued[pid] = (total / 1e9, now)
        if before is None or now <= before[1]:
            return None
        return max(0.0, (total / 1e9 - before[0]) / (now - before[1]))


def part_on(cores: set[int], mine: set[int]) -> float:
    """The part of a process's CPU time that can fall on the rank's cores `mine`, if it may
    run on `cores` (spread evenly, as the scheduler spreads a busy process)."""
    return len(cores & mine) / len(cores) if cores else 0.0


def competitors(pid: int, job_pids: set[int], limit: int = 3) -> list[Competitor]:
    """Processes outside the job busy on the cores the rank may run on (its affinity), the
    busiest there first; empty when the rank may run on every core (then the host load says
    more). A process is charged the part of its CPU time that can fall on the rank's cores (a
    hog pinned to the rank's core all of it, a process free to run on two cores of which one
    is the rank's half), so a process pinned beside the rank ranks above busy ones that run
    anywhere. Samples each candidate over 0.2 s: called only when a verdict is written."""
    try:
        mine = set(psutil.Process(pid).cpu_affinity() or [])
    except (psutil.Error, AttributeError):
        return []
    if not mine or len(mine) >= (psutil.cpu_count() or 1):
        return []
    candidates = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in job_pids or proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, AttributeError):
            cores = set(proc.cpu_affinity())
            if cores & mine:
                proc.cpu_percent()
                candidates.append((proc, part_on(cores, mine)))
    time.sleep(0.2)
    busy: list[Competitor] = []
    for proc, part in candidates:
        with contextlib.suppress(psutil.Error):
            share = proc.cpu_percent() * part
            if share >= 20:
                busy.append({"pid": proc.pid, "name": _name(proc.pid), "percent": share})
    return sorted(busy, key=lambda b: -b["percent"])[:limit]
