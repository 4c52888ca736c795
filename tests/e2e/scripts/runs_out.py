"""Uneven inputs, as they happen: each rank reads its own shard of a file list, and the shards
differ in length, so rank argv[1] runs out of batches first, leaves its loop and exits 0 while
the others are in their next step's all-reduce."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

short = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
batches = [torch.randn(8, 16) for _ in range(6 if rank == short else 12)]
model = DDP(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x in batches:
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {rank} finished its {len(batches)} batches", flush=True)
