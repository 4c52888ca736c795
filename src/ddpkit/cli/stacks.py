"""`ddpkit stacks [JOB]`: every rank's Python stack of a running job, with a verdict, without
stopping it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stacks", help="show where every rank of a running job is", description=__doc__
    )
    p.add_argument("job", nargs="?", help="job id from `ddpkit ps` (default: the only job)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import psutil

    from ddpkit.common import protocol
    from ddpkit.common.procs import job_workers
    from ddpkit.launch.base.snapshot import Reader
    from ddpkit.launch.hang import places

    _, mine = job_workers(args.job, "stacks")
    by_dir: dict[str, dict[int, int]] = {}
    for p in mine:
        state_dir = psutil.Process(p.pid).environ().get(protocol.STATE_DIR)
        if state_dir is None:
            print(f"rank {p.rank} (pid {p.pid}) was not started by ddpkit run: " + _py_spy(p.pid))
            continue
        by_dir.setdefault(state_dir, {})[int(p.rank)] = p.pid
    for state_dir, pids in by_dir.items():
        snap = Reader(Path(state_dir)).look_at(pids)
        line, details = places.describe(snap, stall=0, hung=False)
        print(line)
        print(details)
        print(f"full dumps: {state_dir}/rank*.stacks")
    return 0


def _py_spy(pid: int) -> str:
    if shutil.which("py-spy") is None:
        return "install py-spy to see its stack (`pip install py-spy`)"
    out = subprocess.run(
        ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
    )
    return "\n" + (out.stdout or out.stderr)
