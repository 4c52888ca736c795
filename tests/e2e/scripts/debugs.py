"""Rank 1 stops at a breakpoint() between two all_reduces, as a user debugging one rank does;
then every rank prints the sum."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.full((1,), 6.0)
if dist.get_rank() == 1:
    breakpoint()
dist.all_reduce(x)
print("after", x.item() * 7 / 2, flush=True)
dist.destroy_process_group()
