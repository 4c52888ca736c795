"""Rank 1 fails with exit code 3 after init; the others wait in a collective."""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.3)
    print("rank 1 is about to fail", file=sys.stderr, flush=True)
    sys.exit(3)
dist.all_reduce(torch.ones(1))
time.sleep(60)
