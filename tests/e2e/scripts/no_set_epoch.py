"""A DistributedSampler the script never calls set_epoch on, three epochs, as the classic
mistake: every epoch sees the same order."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
data = TensorDataset(torch.arange(64.0))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data), num_workers=1)
for _epoch in range(3):
    for (x,) in loader:
        dist.all_reduce(x)
print("done", flush=True)
dist.destroy_process_group()
