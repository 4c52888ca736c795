"""The doctor's checks: each reads the facts (and the environment) and returns findings.

A finding has a level (error: the job will fail or hang; warning: it will be slow or fragile;
info: worth knowing), what was found, why it matters and the fix. Checks never start anything;
the smoke test does that.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.common.spelling import misspellings
from ddpkit.doctor.facts import Facts
from ddpkit.env import check_gpu_fit, read_env
from ddpkit.errors import EnvError

LEVELS = ("error", "warning", "info")


@dataclass
class Finding:
    level: str
    check: str
    what: str
    why: str
    fix: str
    where: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CheckFn = Callable[[Facts, dict[str, str]], list[Finding]]
CHECKS: list[CheckFn] = []


def check(fn: CheckFn) -> CheckFn:
    CHECKS.append(fn)
    return fn


def run_all(facts: Facts, environ: dict[str, str]) -> list[Finding]:
    findings = [f for fn in CHECKS for f in fn(facts, environ)]
    return sorted(findings, key=lambda f: LEVELS.index(f.level))


@check
def distributed_variables(facts: Facts, env: dict[str, str]) -> list[Finding]:
    try:
        dist_env = read_env(env)
    except EnvError as err:
        return [
            Finding(
                "error",
                "variables",
                str(err),
                "every rank needs its own valid rank and the job's size, or init fails or blocks",
                err.fix,
            )
        ]
    if dist_env.launcher != "none" and facts.gpus:
        try:
            check_gpu_fit(dist_env, len(facts.gpus))
        except EnvError as err:
            return [
                Finding(
                    "error",
                    "variables",
                    str(err),
                    "two NCCL ranks on one GPU fail or deadlock",
                    err.fix,
                )
            ]
    return []


@check
def misspelt_variables(facts: Facts, env: dict[str, str]) -> list[Finding]:
    return [
        Finding(
            "warning",
            "spelling",
            f"{name} is set, and looks like a misspelling of {meant}",
            f"nothing reads {name}, so the setting you meant has no effect",
            f"rename it: export {meant}={env[name]!r}; unset {name}",
        )
        for name, meant in misspellings(env)
    ]


@check
def visible_devices(facts: Facts, env: dict[str, str]) -> list[Finding]:
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None or not value.strip() or not facts.gpus:
        return []
    entries = [e.strip() for e in value.split(",")]
    findings = []
    numbers = [e for e in entries if e.lstrip("-").isdigit()]
    missing = [e for e in numbers if not 0 <= int(e) < len(facts.gpus)]
    if missing:
        findings.append(
            Finding(
                "error",
                "devices",
                f"CUDA_VISIBLE_DEVICES={value} names GPU {','.join(missing)}, "
                f"but this machine has GPUs 0-{len(facts.gpus) - 1}",
                "CUDA stops at the first invalid entry, so fewer GPUs are visible than you meant",
                f"use indices 0-{len(facts.gpus) - 1} (see `nvidia-smi -L`)",
            )
        )
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    if repeated:
        findings.append(
            Finding(
                "error",
                "devices",
                f"CUDA_VISIBLE_DEVICES={value} repeats GPU {','.join(repeated)}",
                "two ranks would share one GPU, which NCCL refuses or deadlocks on",
                "list each GPU once",
            )
        )
    return findings


@check
def master_address_and_port(facts: Facts, env: dict[str, str]) -> list[Finding]:
    findings = []
    port_text = env.get("MASTER_PORT")
    if port_text and port_text.isdigit():
        port = int(port_text)
        if 0 < port < 1024:
            findings.append(
                Finding(
                    "warning",
                    "port",
                    f"MASTER_PORT={port} is a privileged port (below 1024)",
                    "only root may listen there, and system services use those ports",
                    "pick a port above 1024, or leave MASTER_PORT to `ddpkit run`",
                )
            )
        holder = _port_busy(port)
        if holder is not None:
            findings.append(
                Finding(
                    "error",
                    "port",
                    f"MASTER_PORT={port} is already in use" + (f" by {holder}" if holder else ""),
                    "rank 0 cannot listen there, so init fails (or joins a stranger's job)",
                    "pick a free port, or end the old job (`ddpkit ps`, `ddpkit kill`)",
                )
            )
    addr = env.get("MASTER_ADDR")
    multi_node = _int(env.get("WORLD_SIZE")) > _int(
        env.get("LOCAL_WORLD_SIZE"), _int(env.get("WORLD_SIZE"))
    )
    if addr:
        try:
            resolved = socket.gethostbyname(addr)
        except OSError:
            return findings + [
                Finding(
                    "error",
                    "address",
                    f"MASTER_ADDR={addr} does not resolve",
                    "ranks cannot find rank 0",
                    "use rank 0's IP address or a resolvable name",
                )
            ]
        if resolved.startswith("127.0.1."):
            findings.append(
                Finding(
                    "warning" if not multi_node else "error",
                    "address",
                    f"MASTER_ADDR={addr} resolves to {resolved} (the Debian/Ubuntu hostname entry "
                    "in /etc/hosts)",
                    "other nodes cannot reach a loopback address; on one node "
                    "it works but hides the problem",
                    "use the node's real IP address",
                )
            )
        elif multi_node and ipaddress.ip_address(resolved).is_loopback:
            findings.append(
                Finding(
                    "error",
                    "address",
                    f"MASTER_ADDR={addr} is a loopback address, but the job spans several nodes",
                    "ranks on other nodes cannot reach it",
                    "use rank 0's IP address on the network the nodes share",
                )
            )
    return findings


def _int(text: str | None, default: int = 1) -> int:
    return int(text) if text and text.isdigit() else default


def _port_busy(port: int) -> str | None:
    """None when free, else who holds it ('' when unknown)."""
    from ddpkit.launch.base.ports import port_holder

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return None
        except OSError:
            return port_holder(port)[0]


SHM_MIN = 512 * 2**20


@check
def shared_memory(facts: Facts, env: dict[str, str]) -> list[Finding]:
    if facts.shm_bytes is None or facts.shm_bytes >= SHM_MIN:
        return []
    several = len(facts.gpus) > 1
    return [
        Finding(
            "error" if several else "warning",
            "shm",
            f"/dev/shm is {facts.shm_bytes // 2**20} MiB",
            "NCCL moves data between local GPUs through /dev/shm and DataLoader workers pass "
            "batches through it; Docker's default 64 MiB makes NCCL fail with 'unhandled system "
            "error' and loaders with 'bus error'",
            "run the container with --shm-size=16g (or --ipc=host)",
        )
    ]


NCCL_SWITCHES = {
    "NCCL_P2P_DISABLE": "GPUs stop talking directly (NVLink/PCIe P2P); traffic goes through "
    "host memory, several times slower",
    "NCCL_SHM_DISABLE": "intra-node traffic that would use shared memory uses the network stack",
    "NCCL_IB_DISABLE": "InfiniBand is not used; inter-node traffic falls back to TCP sockets",
    "NCCL_NVLS_ENABLE": "controls NVLink SHARP (multicast); 0 turns it off",
}


@check
def nccl_variables(facts: Facts, env: dict[str, str]) -> list[Finding]:
    findings = []
    for name, effect in NCCL_SWITCHES.items():
        if name in env:
            slow = name != "NCCL_NVLS_ENABLE" and env[name] not in ("0", "")
            findings.append(
                Finding(
                    "warning" if slow else "info",
                    "nccl",
                    f"{name}={env[name]} is set",
                    effect,
                    f"unset {name} unless you set it on purpose",
                )
            )
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = env.get(var)
        if not value:
            continue
        spec = value.lstrip("^=")
        exact = value.startswith("=") or var == "GLOO_SOCKET_IFNAME"
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if value.startswith("^"):
            continue  # an exclusion list: nothing to find
        present = [
            n
            for n in names
            if any((i == n) if exact else i.startswith(n) for i in facts.interfaces)
        ]
        if not present:
            findings.append(
                Finding(
                    "error",
                    "nccl",
                    f"{var}={value} matches no network interface here "
                    f"(have: {', '.join(sorted(facts.interfaces))})",
                    "the backend finds no interface to use and init fails",
                    f"set {var} to one of the interfaces above, or unset it",
                )
            )
    return findings


MEMLOCK_MIN = 2**30


@check
def memlock(facts: Facts, env: dict[str, str]) -> list[Finding]:
    if not facts.infiniband or facts.memlock_bytes is None or facts.memlock_bytes >= MEMLOCK_MIN:
        return []
    return [
        Finding(
            "warning",
            "memlock",
            f"the locked-memory limit is {facts.memlock_bytes // 1024} KiB "
            f"and InfiniBand is present ({', '.join(facts.infiniband)})",
            "RDMA registers memory; a low limit makes NCCL fall back to sockets or fail",
            "raise it: `ulimit -l unlimited` (or memlock in /etc/security/limits.conf, "
            "--ulimit memlock=-1 for Docker)",
        )
    ]


@check
def gpu_health(facts: Facts, env: dict[str, str]) -> list[Finding]:
    findings = []
    for pair, ok in sorted(facts.peer_access.items()):
        if not ok:
            findings.append(
                Finding(
                    "warning",
                    "p2p",
                    f"GPUs {pair.replace('-', ' and ')} cannot access each other's memory (no P2P)",
                    "NCCL routes their traffic through host memory: slower all-reduces",
                    "check `nvidia-smi topo -m`; on VMs enable P2P/ACS passthrough",
                )
            )
    me = os.getpid()
    for gpu in facts.gpus:
        others = [p for p in gpu.processes if p != me]
        if others:
            findings.append(
                Finding(
                    "warning",
                    "busy",
                    f"GPU {gpu.index} is already used by process(es) {', '.join(map(str, others))}",
                    "a job there competes for memory and "
                    "compute, or the GPU is held by a leftover run",
                    "end them if they are leftovers: `ddpkit ps`, `ddpkit kill JOB`",
                )
            )
    if facts.gpus and facts.torch and not facts.nccl_built:
        findings.append(
            Finding(
                "error",
                "nccl",
                "this torch was built without NCCL, and there are GPUs",
                "multi-GPU training falls back to gloo, which is much slower on GPUs",
                "install a CUDA build of torch (pip install torch from the CUDA index)",
            )
        )
    if (
        facts.driver_cuda
        and facts.torch_cuda
        and _version(facts.driver_cuda) < _version(facts.torch_cuda)
    ):
        findings.append(
            Finding(
                "error",
                "driver",
                f"the driver supports CUDA up to {facts.driver_cuda}, but "
                f"torch was built for CUDA {facts.torch_cuda}",
                "CUDA calls fail with 'driver version is insufficient'",
                f"update the NVIDIA driver, or install a torch built for CUDA {facts.driver_cuda}",
            )
        )
    return findings


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


@check
def oversubscription(facts: Facts, env: dict[str, str]) -> list[Finding]:
    threads = _int(env.get("OMP_NUM_THREADS"), 0)
    procs = _int(env.get("LOCAL_WORLD_SIZE"), 0) or len(facts.gpus) or 1
    if threads and facts.cpu_cores and threads * procs > facts.cpu_cores:
        return [
            Finding(
                "warning",
                "threads",
                f"OMP_NUM_THREADS={threads} x {procs} process(es) = "
                f"{threads * procs} threads on {facts.cpu_cores} cores",
                "ranks fight over the cores; CPU work and data loading slow down",
                f"set OMP_NUM_THREADS={max(1, facts.cpu_cores // procs)} (ddpkit run does this "
                "when it is unset)",
            )
        ]
    return []


def across_nodes(nodes: list[dict[str, Any]]) -> list[Finding]:
    """Versions that differ between the nodes of one job (from the smoke test's gather)."""
    findings = []
    for key, name, level in (
        ("torch", "torch", "error"),
        ("nccl", "NCCL", "error"),
        ("cuda", "torch's CUDA", "error"),
        ("driver", "the NVIDIA driver", "warning"),
    ):
        seen = {str(n.get(key)): n["host"] for n in nodes}
        if len(seen) > 1:
            each = ", ".join(f"{host} {value}" for value, host in seen.items())
            findings.append(
                Finding(
                    level,
                    "nodes",
                    f"{name} differs across nodes: {each}",
                    "ranks built against different versions can disagree on collectives "
                    "and hang or fail mid-job",
                    f"install the same {name} version on every node",
                )
            )
    return findings
