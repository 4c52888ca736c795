"""`ddpkit ps`: the distributed-training processes on this machine, orphans flagged."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ps", help="list training processes (ddpkit, torchrun, by hand)", description=__doc__
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def run(args: argparse.Namespace) -> int:
    from ddpkit.common.procs import list_training_processes

    found = list_training_processes()
    if args.json:
        print(json.dumps([asdict(p) for p in found], indent=2))
        return 0
    if not found:
        print("no distributed-training processes on this machine")
        return 0
    header = (
        f"{'JOB':<22} {'ROLE':<8} {'RANK':>4} {'PID':>7} {'STATE':<9} {'AGE':>6} "
        f"{'GPU MiB':>7} {'PORTS':<12} COMMAND"
    )
    print(header)
    for p in found:
        gpu = "-" if p.gpu_mem_mib is None else str(p.gpu_mem_mib)
        ports = ",".join(map(str, p.ports)) or "-"
        flag = "  ORPHAN" if p.orphan else ""
        print(
            f"{p.job[:22]:<22} {p.role:<8} {p.rank or '-':>4} {p.pid:>7} {p.state:<9} "
            f"{_age(p.age_s):>6} {gpu:>7} {ports:<12} {p.cmd}{flag}"
        )
    orphans = sum(p.orphan for p in found)
    if orphans:
        print(f"\n{orphans} orphan(s): their launcher is gone. End a job with `ddpkit kill JOB`.")
    return 0
