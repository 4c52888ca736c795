"""What the launcher's one look per poll costs (launch/snapshot.py): `Reader.look` over N ranks'
real state files (phase, progress record, group; an error on none), at the launcher's poll rate
(20 per second), as the share of one core. The step rings and the process trees are read at
1 Hz and timed apart.

    python benchmarks/snapshot_cost.py --ranks 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from ddpkit.common import protocol
from ddpkit.launch.base.snapshot import Reader
from ddpkit.launch.base.worker import Worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--looks", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        state = Path(folder)
        workers = []
        writers = []
        for rank in range(args.ranks):
            protocol.write_phase(state, rank, "ready")
            protocol.write_group(state, rank, "nccl", 600)
            writers.append(
                protocol.RecordWriter(protocol.state_path(state, rank, protocol.PROGRESS))
            )
            writers.append(protocol.StepWriter(protocol.state_path(state, rank, protocol.STEPS)))
            proc = SimpleNamespace(pid=os.getpid(), poll=lambda: None)
            workers.append(Worker(rank, proc, None))  # type: ignore[arg-type]
        reader = Reader(state)
        rows = {}
        for name, steps, usage in (
            ("every poll", False, False),
            ("steps + trees (1 Hz)", True, True),
        ):
            times = []
            for _ in range(args.looks if not steps else args.looks // 20):
                began = time.perf_counter()
                reader.look(workers, steps=steps, usage=usage)
                times.append(time.perf_counter() - began)
            rows[name] = statistics.median(times)
        per_second = 19 * rows["every poll"] + rows["steps + trees (1 Hz)"]
        print(
            f"ranks {args.ranks}: one look {rows['every poll'] * 1e6:.0f} us; with the step "
            f"rings and process trees {rows['steps + trees (1 Hz)'] * 1e6:.0f} us"
        )
        print(f"at 20 looks a second: {per_second * 100:.2f}% of one core")


if __name__ == "__main__":
    main()
