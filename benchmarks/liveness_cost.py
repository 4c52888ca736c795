"""What the launchers' liveness costs at 2, 3 and 64 nodes: ddpkit's beat (node 0 reads every
node's counters in one call; every other node writes its own counter and reads one key) against
the all-to-all beat it replaced (every node reads every other node's counter every beat).

One TCPStore server plays node 0's launcher; the other nodes are simulated by threads in a few
helper processes, each thread with its own client, beating once a second as a launcher does.
Printed per design and node count: store calls per beat (all nodes), node 0's time per beat
(median and p99) and the CPU node 0's process spends (it serves the store), as a share of one
core. Run: python benchmarks/liveness_cost.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

BEAT = 1.0


def node_thread(port: int, node: int, nodes: int, design: str, stop: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    while not stop.is_set():
        began = time.monotonic()
        store.add(f"beat/{node}", 1)
        if design == "ddpkit":
            store.check(["abort"])
        else:  # all-to-all: read every other node's counter
            store.check(["abort"])
            for other in range(nodes):
                if other != node:
                    store.add(f"beat/{other}", 0)
        time.sleep(max(0.0, BEAT - (time.monotonic() - began)))


def helper(port: int, first: int, last: int, nodes: int, design: str, stop: Any) -> None:
    threads = [
        threading.Thread(target=node_thread, args=(port, n, nodes, design, stop))
        for n in range(first, last)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(nodes: int, design: str, seconds: float) -> dict[str, float]:
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False
    )
    for n in range(nodes):
        server.add(f"beat/{n}", 0)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    others = list(range(1, nodes))
    chunks = [others[i : i + 16] for i in range(0, len(others), 16)]
    procs = [
        ctx.Process(target=helper, args=(server.port, c[0], c[-1] + 1, nodes, design, stop))
        for c in chunks
    ]
    for p in procs:
        p.start()
    keys = [f"beat/{n}" for n in others]
    while keys and not all(server.multi_get(keys) and [int(v) for v in server.multi_get(keys)]):
        time.sleep(0.5)  # every simulated node has started and beaten once
    end = time.monotonic() + seconds
    me = psutil.Process()
    cpu0, wall0 = me.cpu_times(), time.monotonic()
    times = []
    while time.monotonic() < end:
        began = time.perf_counter()
        server.add("beat/0", 1)
        if design == "ddpkit":
            server.multi_get(keys) if keys else None
        else:
            server.check(["abort"])
            for k in keys:
                server.add(k, 0)
        times.append((time.perf_counter() - began) * 1e3)
        time.sleep(max(0.0, BEAT - (time.perf_counter() - began)))
    cpu1, wall1 = me.cpu_times(), time.monotonic()
    stop.set()
    for p in procs:
        p.join()
    per_beat = (2 + (0 if design == "ddpkit" else nodes - 1)) * (nodes - 1) + (
        2 if design == "ddpkit" else nodes
    )
    busy = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (wall1 - wall0)
    return {
        "calls_per_beat": per_beat,
        "node0_ms_median": statistics.median(times),
        "node0_ms_p99": sorted(times)[int(0.99 * (len(times) - 1))],
        "node0_cpu_share": busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--nodes", default="2,3,64")
    args = parser.parse_args()
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for design in ("ddpkit", "all-to-all"):
            rows.append((nodes, design, measure(nodes, design, args.seconds)))
    print(
        f"{'nodes':>5} {'design':<11} {'calls/beat':>10} {'node0 ms p50':>12} "
        f"{'node0 ms p99':>12} {'node0 CPU':>9}"
    )
    for nodes, design, r in rows:
        print(
            f"{nodes:>5} {design:<11} {r['calls_per_beat']:>10.0f} "
            f"{r['node0_ms_median']:>12.3f} {r['node0_ms_p99']:>12.3f} "
            f"{100 * r['node0_cpu_share']:>8.1f}%"
        )


if __name__ == "__main__":
    main()
