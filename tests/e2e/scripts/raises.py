"""Rank 1 raises; rank 0's all_reduce then fails with a connection error (the victim)."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.5)
    raise ValueError("planted failure in rank 1")
dist.all_reduce(torch.ones(1))
dist.all_reduce(torch.ones(1))
time.sleep(60)
