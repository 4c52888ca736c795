"""ddpkit run against torchrun --standalone on the same 2-rank scripts, alternating, same machine.

1. start-up: seconds from starting the launcher to the first line the user's script prints.
2. Ctrl+C with a rank blocked in init_process_group: seconds from SIGINT to every process of the
   job gone (found by a token in their environment, so grandchildren count too).
3. exit: how many runs of a plain 2-rank DDP script end with a non-zero code (torch's gloo
   abort at interpreter shutdown).

Prints medians and ratios (ddpkit / torchrun; below 1 is better for ddpkit).
Usage: python benchmarks/launch_vs_torchrun.py [--runs 7] [--exit-runs 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

FIRST_LINE = "import sys\nprint('first user line', flush=True)\nimport torch.distributed\n"
BLOCKED_IN_INIT = """import os, time
import torch.distributed as dist
print('ready', flush=True)
if os.environ['RANK'] == '1':
    time.sleep(600)
dist.init_process_group('gloo')
"""
PLAIN_DDP = """import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group('gloo')
model = DDP(torch.nn.Linear(8, 8))
model(torch.randn(4, 8)).sum().backward()
dist.destroy_process_group()
"""


def launcher(kind: str, script: Path, extra: list[str] | None = None) -> list[str]:
    if kind == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ]
    return [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "-n",
        "2",
        "--grace",
        "5",
        *(extra or []),
        str(script),
    ]


def job_processes(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("BENCH_TOKEN") == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    token = uuid.uuid4().hex
    # CPU ranks for both launchers, also on a GPU machine (the scripts use gloo)
    env = {**os.environ, "BENCH_TOKEN": token, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,
    )
    return proc, token


def wait_line(proc: subprocess.Popen, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise RuntimeError(f"exited before {text!r}")
    raise RuntimeError(f"no {text!r}")


def startup(kind: str, script: Path) -> float:
    began = time.perf_counter()
    proc, _ = start(launcher(kind, script))
    wait_line(proc, "first user line")
    took = time.perf_counter() - began
    proc.wait(60)
    return took


def ctrl_c(kind: str, script: Path) -> float:
    proc, token = start(launcher(kind, script))
    wait_line(proc, "ready")
    wait_line(proc, "ready")
    time.sleep(2)  # rank 0 is now blocked in init_process_group
    began = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    while proc.poll() is None or job_processes(token):
        if time.perf_counter() - began > 120:
            for p in job_processes(token):
                p.kill()
            return float("inf")
        time.sleep(0.02)
    return time.perf_counter() - began


def exit_failures(kind: str, script: Path, runs: int) -> int:
    failures = 0
    for _ in range(runs):
        proc, token = start(launcher(kind, script))
        proc.communicate(timeout=120)
        failures += proc.returncode != 0
        for p in job_processes(token):
            p.kill()
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--exit-runs", type=int, default=20)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    scripts = {}
    for name, text in (("first", FIRST_LINE), ("blocked", BLOCKED_IN_INIT), ("ddp", PLAIN_DDP)):
        scripts[name] = tmp / f"{name}.py"
        scripts[name].write_text(text)
    kinds = ("ddpkit", "torchrun")
    results: dict[str, dict[str, list[float]]] = {k: {"startup": [], "ctrl_c": []} for k in kinds}
    for _ in range(args.runs):  # alternate, so drift hits both alike
        for kind in kinds:
            results[kind]["startup"].append(startup(kind, scripts["first"]))
            results[kind]["ctrl_c"].append(ctrl_c(kind, scripts["blocked"]))
    failures = {k: exit_failures(k, scripts["ddp"], args.exit_runs) for k in kinds}
    print(f"\n{args.runs} alternating runs each; median seconds (min-max)")
    print(f"{'measure':<34} {'ddpkit run':>18} {'torchrun':>18} {'ratio':>7}")
    for measure, label in (
        ("startup", "start -> first user line"),
        ("ctrl_c", "Ctrl+C (rank in init) -> all dead"),
    ):
        med = {k: statistics.median(results[k][measure]) for k in kinds}
        span = {
            k: f"{med[k]:.2f} ({min(results[k][measure]):.2f}-{max(results[k][measure]):.2f})"
            for k in kinds
        }
        print(
            f"{label:<34} {span['ddpkit']:>18} {span['torchrun']:>18} "
            f"{med['ddpkit'] / med['torchrun']:>7.2f}"
        )
    print(
        f"{'2-rank DDP runs exiting non-zero':<34} {failures['ddpkit']:>15}/{args.exit_runs} "
        f"{failures['torchrun']:>15}/{args.exit_runs}"
    )


if __name__ == "__main__":
    main()
