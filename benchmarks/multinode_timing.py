"""How fast a 2-node job (network namespaces, 198.18.0.0/15, one per node) notices faults, and how
late the launchers' beats come when every core is busy: the figures behind --node-timeout's
default and docs/launcher.md "Several machines".

  * kill:  node 1's launcher SIGKILLed -> node 0 has stopped (s)
  * cut:   node 1's link down -> both nodes have stopped (s)
  * term:  node 1's link down, then SIGTERM to node 1's launcher -> it has stopped (s)
  * gap:   the longest time between two answered beats, 2 nodes x 2 ranks computing on every
           core for 40 s (DDPKIT_DEBUG=1 prints it)

Needs root (namespaces). Run: python benchmarks/multinode_timing.py [--repeat 3] [--node-timeout 10]
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.multinode.cluster import Cluster

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "multinode" / "scripts" / "multinode.py"


def start(cluster: Cluster, tmp: Path, node_timeout: float, extra: list[str], env=None):
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = "bm" + uuid.uuid4().hex[:6]
    procs = []
    for k in (0, 1):
        cmd = [sys.executable, "-m", "ddpkit", "run", "--run-id", run_id, "--grace", "2"]
        cmd += ["--log-dir", str(tmp / f"n{k}"), "--node-timeout", str(node_timeout)]
        cmd += ["--nnodes", "2", "--rdzv", "node0:29400", "-n", "2", str(SCRIPT), *extra]
        procs.append(cluster.start(k, cmd, cwd=tmp, env=env))
    return procs


def fault(kind: str, node_timeout: float, tmp: Path) -> float:
    cluster = Cluster(2)
    try:
        procs = start(cluster, tmp, node_timeout, ["600", "--sleep", "1"])
        for p in procs:
            p.wait_for("Epoch 0", 120)
        began = time.monotonic()
        if kind == "kill":
            procs[1].popen.send_signal(signal.SIGKILL)
            procs[0].finish(120)
        elif kind == "cut":
            cluster.cut(1)
            for p in procs:
                p.finish(120)
        else:
            cluster.cut(1)
            procs[1].popen.send_signal(signal.SIGTERM)
            procs[1].finish(120)
        took = time.monotonic() - began
        for p in procs:
            p.finish(120)
        return took
    finally:
        cluster.close()


def gap(node_timeout: float, tmp: Path) -> float:
    cluster = Cluster(2)
    try:
        procs = start(
            cluster,
            tmp,
            node_timeout,
            ["1", "--compute-rank", "-2", "--compute-seconds", "40"],  # every rank, every core
            env={"DDPKIT_DEBUG": "1"},
        )
        for p in procs:
            p.finish(300)
        found = [float(x) for p in procs for x in re.findall(r"longest gap ([\d.]+) s", p.stderr)]
        return max(found) if found else float("nan")
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--node-timeout", type=float, default=10.0)
    parser.add_argument("--tmp", default="/tmp/ddpkit-bench-multinode")
    args = parser.parse_args()
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    rows = {}
    for kind in ("kill", "cut", "term"):
        rows[kind] = [
            fault(kind, args.node_timeout, tmp / f"{kind}{i}") for i in range(args.repeat)
        ]
    rows["gap"] = [gap(args.node_timeout, tmp / f"gap{i}") for i in range(args.repeat)]
    print(f"--node-timeout {args.node_timeout:g} s, --grace 2 s, beat 1 s")
    print(f"{'what':<6} {'median s':>9} {'max s':>7}  runs")
    for kind, took in rows.items():
        runs = " ".join(f"{t:.2f}" for t in took)
        print(f"{kind:<6} {statistics.median(took):>9.2f} {max(took):>7.2f}  {runs}")


if __name__ == "__main__":
    main()
