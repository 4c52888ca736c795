"""A common mistake: rank 0 (argv[1]) evaluates alone for argv[2] seconds while the other
ranks go on to the next step's all_reduce and wait for it. The process group's timeout is
argv[3] seconds (0: torch's default), as in `init_process_group(..., timeout=...)`.

argv[1] may name several ranks, "2,0": each evaluates alone in turn, one step apart (one
episode of waiting each)."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

evaluators, seconds = [int(r) for r in sys.argv[1].split(",")], float(sys.argv[2])
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 0


def evaluate(seconds):
    end = time.time() + seconds
    total = 0.0
    while time.time() < end:  # busy, as a real evaluation loop is (a stack lands on line 24)
        total += sum(i * i for i in range(100_000))
    return total


kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
dist.init_process_group("gloo", **kwargs)
rank = int(os.environ["RANK"])
ones = torch.ones(1)  # held until the end: see below
for step in range(2 + len(evaluators)):
    dist.all_reduce(ones)
    if 1 <= step <= len(evaluators) and rank == evaluators[step - 1]:
        evaluate(seconds)
print("done", flush=True)
# On torch 2.4 a collective's temporary tensor, released by gloo's worker thread after the
# call returned, can deadlock destroy_process_group (it joins that thread holding the GIL,
# and the thread waits for the GIL to free the tensor's Python object): a rank stuck there.
# Holding the tensor in the script keeps the last reference here.
dist.destroy_process_group()
