"""What a 2-rank job costs the machine under `ddpkit run` and under `torchrun --standalone`
(issue 28): CPU seconds of the whole job (the launcher and everything it started, from
getrusage of the reaped tree) and seconds from starting the launcher to the script's first
training step. The script is the DDP tutorial's loop on a tiny model, 20 steps. Runs alternate
between the launchers; medians and ratios (ddpkit / torchrun) are printed.

    python benchmarks/job_cost.py [--runs 7] [--ranks 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    loss = model(torch.randn(8, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0 and dist.get_rank() == 0:
        print("first step", flush=True)
dist.destroy_process_group()
"""


def command(kind: str, script: Path, ranks: int, logs: Path) -> list[str]:
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), str(script)]  # fmt: skip
    return [sys.executable, "-m", "ddpkit", "run", "-n", str(ranks), "--log-dir", str(logs),
            str(script)]  # fmt: skip


def one_job(kind: str, script: Path, ranks: int, logs: Path) -> tuple[float, float]:
    """(CPU seconds of the job, seconds to its first step)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    proc = subprocess.Popen(
        command(kind, script, ranks, logs),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = float("nan")
    assert proc.stdout is not None
    for line in proc.stdout:
        if "first step" in line and first != first:
            first = time.perf_counter() - began
    if proc.wait() != 0:
        raise SystemExit(f"{kind} failed")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    kinds = ("ddpkit", "torchrun")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train.py"
        script.write_text(SCRIPT)
        one_job("ddpkit", script, args.ranks, Path(folder) / "logs")  # warm caches
        for run in range(args.runs):
            for kind in kinds if run % 2 == 0 else kinds[::-1]:
                results[kind].append(one_job(kind, script, args.ranks, Path(folder) / "logs"))
    import torch

    print(f"# a {args.ranks}-rank DDP job of 20 tiny steps, torch {torch.__version__}, "
          f"{args.runs} runs each, alternating, medians")  # fmt: skip
    print(f"{'launcher':<10} {'CPU s':>7} {'first step s':>13}")
    medians = {}
    for kind in kinds:
        cpu = statistics.median(c for c, _ in results[kind])
        first = statistics.median(f for _, f in results[kind])
        medians[kind] = (cpu, first)
        print(f"{kind:<10} {cpu:>7.2f} {first:>13.2f}")
    ratio_cpu = medians["ddpkit"][0] / medians["torchrun"][0]
    ratio_first = medians["ddpkit"][1] / medians["torchrun"][1]
    print(f"{'ratio':<10} {ratio_cpu:>7.2f} {ratio_first:>13.2f}   (ddpkit / torchrun)")


if __name__ == "__main__":
    main()
