"""What the doctor reports: the machine, the software, the GPUs and their links, the variables.

Facts are plain data (dataclasses), gathered once; the checks read them, so each check can be
tried on crafted facts. GPU facts come from NVML when nvidia-ml-py is installed and from torch
otherwise; a machine without GPUs simply has none.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import resource
import shutil
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpkit.common.network import infiniband_devices
from ddpkit.errors import debug_note

WATCHED_PREFIXES = (
    "NCCL_",
    "TORCH_",
    "CUDA_",
    "GLOO_",
    "OMP_",
    "SLURM_",
    "OMPI_",
    "DDPKIT_",
    "TORCHELASTIC_",
)
DISTRIBUTED_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
)


@dataclass
class Gpu:
    index: int
    name: str
    memory_mib: int
    bus_id: str
    processes: list[int] = field(default_factory=list)  # pids using it
    nvlinks_active: int = 0
    nvlink_version: str = ""


@dataclass
class Facts:
    os: str = ""
    kernel: str = ""
    python: str = ""
    torch: str = ""
    torch_cuda: str | None = None
    nccl: str | None = None
    nccl_built: bool = False
    driver: str | None = None
    driver_cuda: str | None = None  # the newest CUDA the driver supports, e.g. "13.0"
    gpus: list[Gpu] = field(default_factory=list)
    peer_access: dict[str, bool] = field(default_factory=dict)  # "0-1": True
    topology: str = ""
    cpu_cores: int = 0
    shm_bytes: int | None = None
    memlock_bytes: int | None = None  # None: unlimited
    infiniband: list[str] = field(default_factory=list)
    variables: dict[str, str] = field(default_factory=dict)
    interfaces: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gather(environ: dict[str, str] | None = None) -> Facts:
    env = dict(os.environ if environ is None else environ)
    facts = Facts(
        os=_os_name(),
        kernel=platform.release(),
        python=sys.version.split()[0],
        cpu_cores=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 0,
        shm_bytes=shm_size(),
        memlock_bytes=memlock_limit(),
        infiniband=infiniband_devices(),
        variables={k: v for k, v in sorted(env.items()) if watched(k)},
        interfaces=interfaces(),
    )
    _nvml(facts)
    _torch(facts)
    return facts


def watched(name: str) -> bool:
    return name.startswith(WATCHED_PREFIXES) or name in DISTRIBUTED_NAMES


def shm_size(path: str = "/dev/shm") -> int | None:
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def memlock_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def interfaces() -> dict[str, list[str]]:
    import socket

    import psutil

    found: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        found[name] = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    return found


def _os_name() -> str:
    try:
        with open("/etc/os-release") as f:
            text = f.read()
        m = re.search(r'^PRETTY_NAME="?([^"\n]+)', text, re.M)
        if m:
            return m.group(1)
    except OSError:
        pass
    return platform.platform()


def _nvml(facts: Facts) -> None:
    from ddpkit.common.gpus import NVLINK, nvml

    with nvml() as pynvml:
        if pynvml is None:
            return
        try:
            facts.driver = _text(pynvml.nvmlSystemGetDriverVersion())
            version = pynvml.nvmlSystemGetCudaDriverVersion()
            facts.driver_cuda = f"{version // 1000}.{version % 1000 // 10}"
            for i in range(pynvml.nvmlDeviceGetCount()):
                facts.gpus.append(_gpu(pynvml, i, NVLINK))
        except Exception as err:  # the report goes on with what NVML did say
            debug_note("doctor NVML facts", err)
    _topology(facts)


def _gpu(pynvml: Any, i: int, nvlink: dict[int, tuple[str, float]]) -> Gpu:
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    gpu = Gpu(
        i,
        _text(pynvml.nvmlDeviceGetName(h)),
        pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,
        _text(pynvml.nvmlDeviceGetPciInfo(h).busId),
    )
    with contextlib.suppress(pynvml.NVMLError):
        gpu.processes = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link):
                gpu.nvlinks_active += 1
                enum = pynvml.nvmlDeviceGetNvLinkVersion(h, link)
                gpu.nvlink_version = nvlink.get(enum, (str(enum), 0))[0]
        except pynvml.NVMLError:
            break
    return gpu


def _topology(facts: Facts) -> None:
    if shutil.which("nvidia-smi"):
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30
        )
        facts.topology = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip()


def _torch(facts: Facts) -> None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return
    facts.torch = torch.__version__
    facts.torch_cuda = torch.version.cuda
    facts.nccl_built = dist.is_available() and dist.is_nccl_available()
    if facts.nccl_built and torch.cuda.is_available():
        facts.nccl = ".".join(map(str, torch.cuda.nccl.version()))
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if not facts.gpus:
            for i in range(n):
                p = torch.cuda.get_device_properties(i)
                facts.gpus.append(Gpu(i, p.name, p.total_memory // 2**20, ""))
        for a in range(n):
            for b in range(a + 1, n):
                facts.peer_access[f"{a}-{b}"] = bool(torch.cuda.can_device_access_peer(a, b))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
