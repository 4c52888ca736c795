"""The doctor's smoke test, one rank of it: an all_reduce whose exact result is known, then
one large all_reduce timed, and every node's versions and network facts gathered. Local rank 0
of every node prints one `DDPKIT_SMOKE {json}` line (the same on every node).
`ddpkit doctor` starts it through the launcher, with hard time bounds."""

from __future__ import annotations

import json
import os
import socket
import time

import torch
import torch.distributed as dist

import ddpkit


def main() -> None:
    with ddpkit.setup() as s:
        n = s.world_size
        values = torch.full((4096,), float(s.rank + 1), device=s.device)
        dist.all_reduce(values)
        wrong = int((values != n * (n + 1) / 2).sum())
        size = (256 if s.device.type == "cuda" else 16) * 2**20
        # one rank sends nothing to anyone: a time for it would be a copy's, not a link's
        us, busbw = timed_all_reduce(s, size) if n > 1 else (None, None)
        wrong = s.reduce(wrong, op="sum")  # every rank takes part, not only rank 0
        nodes = {f["host"]: f for f in s.gather(node_facts(s.backend))}
        if s.local_rank == 0:
            print(
                "DDPKIT_SMOKE "
                + json.dumps(
                    {
                        "ranks": n,
                        "backend": s.backend,
                        "wrong": wrong,
                        "bytes": size,
                        "time_us": us,
                        "busbw_gbps": busbw,
                        "nodes": list(nodes.values()),
                    }
                ),
                flush=True,
            )


def timed_all_reduce(s: ddpkit.Session, size: int) -> tuple[float, float]:
    """(microseconds, bus bandwidth in GB/s) of an all_reduce of `size` bytes, the slowest
    rank's time, after two warm-up calls."""
    n = s.world_size
    data = torch.ones(size // 4, device=s.device)
    for _ in range(2):
        dist.all_reduce(data)
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    s.barrier()
    iters = 5
    began = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    us = s.reduce((time.perf_counter() - began) * 1e6 / iters, op="max")
    busbw = size / us / 1e3 * 2 * (n - 1) / n  # nccl-tests' formula for all_reduce
    return round(us, 1), round(busbw, 2)


def node_facts(backend: str) -> dict[str, object]:
    """What must match across nodes, and how this node reaches node 0."""
    from ddpkit.common.network import address_toward, interface_of

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    address = address_toward(master)
    nccl = None
    if backend == "nccl":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    from ddpkit.common.gpus import nvml

    driver = None
    with nvml() as pynvml:
        if pynvml is not None:
            raw = pynvml.nvmlSystemGetDriverVersion()
            driver = raw.decode() if isinstance(raw, bytes) else str(raw)
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return {
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "driver": driver,
        "address": address,
        "interface": os.environ.get(variable) or interface_of(address),
    }


if __name__ == "__main__":
    main()
