"""What a resume at another world size costs: `s.load_state` of a state saved by 4 ranks (a
~17M-parameter model, SGD with momentum, an s.loader over 100,000 samples mid-epoch), timed
at 4 ranks (the same size: the baseline) and at 3, 2 and 1 (the loader's place follows, the
random streams are re-seeded), every rank under `ddpkit run`, gloo on the CPU. Each load is
timed between two barriers, the slowest rank's time counts; the median of --repeat loads.

    python benchmarks/resize_load_cost.py [--repeat 5] [--worlds 4,3,2,1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAVED_BY = 4


def model_and_data():
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048))
    data = TensorDataset(torch.arange(100_000))
    return model, data


def rank_main(mode: str, folder: Path, repeat: int) -> None:
    import torch

    import ddpkit

    with ddpkit.setup(seed=0) as s:
        model, data = model_and_data()
        model = s.wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = s.loader(data, batch_size=10)
        if mode == "save":
            for step, _ in enumerate(loader):
                if step == 1000:
                    break
            model(torch.zeros(1, 2048)).sum().backward()
            opt.step()  # momentum buffers exist
            s.save_state(folder / "state", model=model, optimizer=opt, loader=loader)
            return
        times = []
        for _ in range(repeat):
            loader = s.loader(data, batch_size=10)
            s.barrier()
            began = time.perf_counter()
            s.load_state(folder / "state", model=model, optimizer=opt, loader=loader)
            s.barrier()
            times.append(time.perf_counter() - began)
        slowest = [max(t) for t in zip(*s.gather(times), strict=True)]
        if s.rank == 0:
            (folder / f"load{s.world_size}.json").write_text(json.dumps(slowest))


def run(world: int, mode: str, folder: Path, repeat: int) -> None:
    command = [sys.executable, "-m", "ddpkit", "run", "-n", str(world), __file__,
               "--rank-mode", mode, "--folder", str(folder), "--repeat", str(repeat)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if done.returncode:
        sys.exit(f"ddpkit run -n {world} ({mode}) failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--worlds", default="4,3,2,1")
    parser.add_argument("--rank-mode", choices=["save", "load"])
    parser.add_argument("--folder", type=Path)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args.rank_mode, args.folder, args.repeat)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run(SAVED_BY, "save", folder, 1)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        medians = {}
        for world in (int(w) for w in args.worlds.split(",")):
            run(world, "load", folder, args.repeat)
            medians[world] = statistics.median(
                json.loads((folder / f"load{world}.json").read_text())
            )
    base = medians.get(SAVED_BY)
    print(f"load_state of a state saved by {SAVED_BY} ranks ({size / 2**20:.0f} MiB), "
          f"median of {args.repeat}, slowest rank, gloo on {os.cpu_count()} CPU cores")  # fmt: skip
    print(f"{'world size':>10}  {'load (s)':>9}  {'vs same size':>12}")
    for world, seconds in medians.items():
        ratio = f"{seconds / base:.2f}x" if base else "-"
        print(f"{world:>10}  {seconds:>9.3f}  {ratio:>12}")


if __name__ == "__main__":
    main()
