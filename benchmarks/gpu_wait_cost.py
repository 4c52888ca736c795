"""What telling a GPU that never finishes from a busy one costs (issue 35), in one run at world
size 1 on a GPU, GPT-2-small in bf16 under DDP over NCCL:

* the rank's tick thread now also samples where the script's thread stands and how many
  allocations torch's CUDA allocator has served (ddpkit.rank.progress), every 0.5 s: blocks of
  steps with that tick running alternate with blocks with it paused;
* `ddpkit run` turns NCCL's timing on (TORCH_NCCL_ENABLE_TIMING=1: a start event per
  collective, so the flight recorder tells a started collective from a queued one): two DDP
  models on two process groups, one made with timing and one without, alternate.

Each block is timed end to end (synchronised), after a warm-up; the table gives the medians and
the ratio. Run alone: `python benchmarks/gpu_wait_cost.py --batch 8` (benchmarks/gpu.sh hang).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def block(model, opt, x, y, steps: int) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # as a training loop that logs its loss each step
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps


def ticking(running: threading.Event) -> None:
    """The tick thread's sampling, as ddpkit.rank.progress does it, while `running` is set."""
    from ddpkit.rank import progress

    main = threading.main_thread().ident
    at, gpu = None, torch.cuda.current_device()
    while True:
        running.wait()
        frame = sys._current_frames().get(main)
        here = (id(frame), frame.f_lasti, progress._allocations(gpu)) if frame else None
        del frame
        at = here if here != at else at
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "0"
    torch.cuda.set_device(0)
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    timed_group = dist.new_group([0])
    from ddpkit.bench.models import gpt

    base, make = gpt()
    x, y = make(args.batch, torch.device("cuda"))
    plain = DistributedDataParallel(base.cuda(), device_ids=[0])
    timed = DistributedDataParallel(
        copy.deepcopy(base).cuda(), device_ids=[0], process_group=timed_group
    )
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (plain, timed)}
    running = threading.Event()
    threading.Thread(target=ticking, args=(running,), daemon=True).start()
    for m in (plain, timed):
        block(m, opts[m], x, y, 5)  # warm-up
    results: dict[str, list[float]] = {"plain": [], "tick": [], "timing": []}
    for i in range(args.rounds):
        order = ["plain", "tick", "timing"] if i % 2 == 0 else ["timing", "tick", "plain"]
        for kind in order:
            if kind == "tick":
                running.set()
            model = timed if kind == "timing" else plain
            results[kind].append(block(model, opts[model], x, y, args.steps))
            running.clear()
    base_ms = statistics.median(results["plain"])
    print(f"# GPT-2-small bf16 batch {args.batch}, 1 GPU ({torch.cuda.get_device_name()}), "
          f"{args.rounds} blocks of {args.steps} steps each, medians")  # fmt: skip
    print(f"{'case':<34} {'step':>9} {'vs plain':>9}")
    for kind, label in (
        ("plain", "DDP over NCCL, no tick"),
        ("tick", "+ tick sampling place and allocs"),
        ("timing", "+ TORCH_NCCL_ENABLE_TIMING=1"),
    ):
        t = statistics.median(results[kind])
        print(f"{label:<34} {t * 1e3:>7.2f}ms {(t - base_ms) / base_ms:>+9.2%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
