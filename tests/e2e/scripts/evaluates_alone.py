"""A common mistake: rank 0 (argv[1]) evaluates alone for argv[2] seconds while the other
ranks go on to the next step's all_reduce and wait for it. The process group's timeout is
argv[3] seconds (0: torch's default), as in `init_process_group(..., timeout=...)`."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

evaluator, seconds = int(sys.argv[1]), float(sys.argv[2])
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 0


def evaluate(seconds):
    end = time.time() + seconds
    total = 0.0
    while time.time() < end:  # busy, as a real evaluation loop is
        total += sum(i * i for i in range(1000))
    return total


kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
dist.init_process_group("gloo", **kwargs)
rank = int(os.environ["RANK"])
for step in range(3):
    dist.all_reduce(torch.ones(1))
    if step == 1 and rank == evaluator:
        evaluate(seconds)
print("done", flush=True)
dist.destroy_process_group()
