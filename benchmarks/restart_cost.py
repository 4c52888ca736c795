"""Failure to the restarted job's first step (issue 38: at most 0.5x torchrun's), side by side
on the same job: the pytorch/examples ddp-tutorial-series trainer (tests/e2e/scripts/
snapshot_trainer.py) saving every 10 steps, rank 1 raising at step 25 of the first attempt,
`--max-restarts 1`, under

    torchrun         python -m torch.distributed.run --standalone --max-restarts 1
    ddpkit cold      ddpkit run --max-restarts 1 --no-spares  (every rank starts anew)
    ddpkit           ddpkit run --max-restarts 1              (warm spares take the places)

The time is the script's own: the failing rank prints the wall time just before it raises,
rank 0 the wall time after each step; failure to first step is the first step of the second
attempt less the failure. Also counted: the steps done twice (the first attempt's steps at or
after the step the second began with). Each case --runs times, alternating; medians printed.

    python benchmarks/restart_cost.py --ranks 2,4 --runs 3
    python benchmarks/restart_cost.py --ranks 1 --fail-rank 0      # one GPU: the rank itself

On a GPU the ranks train on it (NCCL); one rank has no peer to keep its step: the restart
resumes from the last save, and the figure is the restart's time alone.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "tests" / "e2e" / "scripts" / "snapshot_trainer.py"
FAILED = re.compile(r"stamp failed (\d+\.\d+)")
STEP = re.compile(r"stamp attempt (\d+) step (\d+) (\d+\.\d+)")


def command(how: str, ranks: int, folder: Path) -> list[str]:
    job = [str(SCRIPT), "2", "1", "--batch_size", "4", "--snapshot_path", str(folder / "state"),
           "--save_steps", "10", "--fail_rank", str(args.fail_rank), "--fail_step", "25",
           "--stamps",
           "--sleep", str(args.sleep)]  # fmt: skip
    if how == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={ranks}", "--max-restarts=1", *job]  # fmt: skip
    cold = ["--no-spares"] if how == "ddpkit cold" else []
    return [sys.executable, "-m", "ddpkit", "run", "-n", str(ranks), "--max-restarts", "1",
            "--log-dir", str(folder / "logs"), *cold, *job]  # fmt: skip


def one(how: str, ranks: int) -> tuple[float, int]:
    """(seconds from the failure to the second attempt's first step, steps done twice)"""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(command(how, ranks, Path(folder)), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    text = done.stdout + done.stderr
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        (args.keep / f"{how.replace(' ', '_')}-{ranks}-{time.time():.0f}.txt").write_text(text)
    if done.returncode != 0 or not FAILED.search(text):
        raise SystemExit(f"{how} at {ranks} ranks ended {done.returncode}:\n{text[-3000:]}")
    failed = float(FAILED.search(text)[1])
    steps = [(int(a), int(s), float(t)) for a, s, t in STEP.findall(text)]
    second = [(s, t) for a, s, t in steps if a == 1]
    first_step, first_end = min(second)
    again = sum(1 for a, s, _ in steps if a == 0 and s >= first_step)
    return first_end - failed, again


def main() -> None:
    ranks_list = [int(r) for r in args.ranks.split(",")]
    hows = ["torchrun", "ddpkit cold", "ddpkit"]
    results: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for ranks in ranks_list:
        for _ in range(args.runs):
            for how in hows:
                results.setdefault((how, ranks), []).append(one(how, ranks))
                took, again = results[(how, ranks)][-1]  # as it comes: a cut-short lease keeps it
                print(f"run: {ranks} ranks, {how}: {took:.2f} s, {again} steps again", flush=True)
                time.sleep(0.5)
    print(f"failure to the restarted job's first step (median of {args.runs}; rank "
          f"{args.fail_rank} raises at "
          f"step 25, saves every 10)")  # fmt: skip
    print(f"{'ranks':>5}  {'launcher':<12}{'seconds':>9}{'x torchrun':>12}{'steps again':>13}")
    for ranks in ranks_list:
        base = statistics.median(t for t, _ in results[("torchrun", ranks)])
        for how in hows:
            times = [t for t, _ in results[(how, ranks)]]
            again = statistics.median(a for _, a in results[(how, ranks)])
            median = statistics.median(times)
            print(f"{ranks:>5}  {how:<12}{median:>9.2f}{median / base:>12.2f}{again:>13g}"
                  f"   (runs: {', '.join(f'{t:.2f}' for t in times)})")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--keep", type=Path, help="a folder for each run's output")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=1, help="0 for one rank (one GPU)")
    parser.add_argument("--sleep", type=float, default=0.3, help="seconds per step (the spares "
                        "import torch during the first steps)")  # fmt: skip
    args = parser.parse_args()
    main()
