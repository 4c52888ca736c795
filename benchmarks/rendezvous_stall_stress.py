"""A node's launcher paused while the nodes meet, many times over (issue 37: the race that
left node 1 out of a round node 0 was in). Two network namespaces (tests/multinode/cluster.py)
each run `ddpkit run --nnodes 2 --rdzv node0:29400` of the DDP tutorial's multinode.py, with
the rendezvous keep-alive short (1 s x 2, as tests/multinode's elastic jobs use) so that a
pause longer than 2 s makes torch drop the paused node from the round the other node reads.
At a random moment in the first seconds, one launcher (chosen at random) is stopped with
SIGSTOP for a random 2.2-3.5 s (shorter than --node-timeout 5), then continued.

A run passes when both launchers exit 0, every rank trained, no traceback was printed, and no
process of the job is left: a pause of 3 s must cost a new round, not the job. Counted: runs,
passes, runs whose nodes met again ("the nodes meet again"), verdicts (a clear message, but
the job lost: counted against), failures (with their output). Before the fix, 2 runs of 10
ended after --init-timeout with "did not meet" or "never reached the job's store".

    python benchmarks/rendezvous_stall_stress.py [--runs 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from tests.multinode.cluster import Cluster, available  # noqa: E402

from ddpkit.common.procs import is_alive, processes_of_job  # noqa: E402

SCRIPT = ROOT / "tests" / "multinode" / "scripts" / "multinode.py"
CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
TRACES = ("Traceback", "Exception raised from", "IndexError")


def one_run(
    cluster: Cluster, folder: Path, rng: random.Random, debug: bool = False
) -> tuple[str, str]:
    run_id = "st" + uuid.uuid4().hex[:6]
    host = cluster.nodes[0].host
    procs = []
    for k in range(2):
        cmd = [sys.executable, "-m", "ddpkit", "run", "--run-id", run_id, "--nnodes", "2",
               "--rdzv", f"{host}:29400", "--rdzv-conf", CONF, "--init-timeout", "60",
               "--node-timeout", "5", "--log-dir", str(folder / f"node{k}"), "-n", "1",
               str(SCRIPT), "2", "1"]  # fmt: skip
        # LOGLEVEL: torch elastic's own loggers (who joined, who was dropped, each round)
        env = {"LOGLEVEL": "DEBUG"} if debug else None
        procs.append(cluster.start(k, cmd, cwd=folder, env=env))
    victim = rng.randrange(2)
    time.sleep(rng.uniform(0.5, 4.0))
    pid = procs[victim].popen.pid
    pause = rng.uniform(2.2, 3.5)
    with_pause = procs[victim].popen.poll() is None
    if with_pause:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(pid, signal.SIGCONT)
    codes = []
    for p in procs:
        try:
            codes.append(p.finish(120))
        except AssertionError:
            codes.append(None)
    said = "".join(p.stdout + p.stderr for p in procs)
    deadline = time.monotonic() + 15
    left: list = []
    while time.monotonic() < deadline:
        left = [p for p in processes_of_job(run_id) if is_alive(p)]
        if not left:
            break
        time.sleep(0.1)
    for p in left:
        p.kill()
    what = f"node {victim} paused {pause:.1f} s" if with_pause else "ended before the pause"
    if left or None in codes or any(t in said for t in TRACES):
        return "failed", f"{what}; codes {codes}; left {left}\n{said[-4000:]}"
    if codes == [0, 0] and said.count("] done") == 2:
        again = sorted(
            {line.split("meet again: ")[1] for line in said.splitlines() if "meet again: " in line}
        )
        return ("met again" if again else "passed"), "; ".join([what, *again])
    if all(c == 1 for c in codes) and said.count("fix:") >= 2:
        return "verdict", f"{what}\n{said[-(60000 if debug else 1500) :]}"
    return "failed", f"{what}; codes {codes}\n{said[-4000:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--debug", action="store_true", help="torch elastic's debug log too")
    args = parser.parse_args()
    why = available()
    if why is not None:
        print(f"no namespaces: {why}")
        return 2
    # a stopped stress still takes its namespaces and launchers away (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    lines = []
    cluster = Cluster(2)
    try:
        for n in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                began = time.monotonic()
                kind, detail = one_run(cluster, Path(tmp), rng, args.debug)
            counts[kind] += 1
            line = f"run {n + 1:3d}: {kind:9s} {time.monotonic() - began:5.1f} s  {detail}"
            print(line if kind != "failed" else line, flush=True)
            lines.append(line)
    finally:
        cluster.close()
    table = "  ".join(f"{k}: {counts[k]}" for k in ("passed", "met again", "verdict", "failed"))
    summary = f"{args.runs} runs: {table}"
    print(summary)
    if args.out:
        args.out.write_text("\n".join([*lines, summary]) + "\n")
    return 1 if counts["failed"] or counts["verdict"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
