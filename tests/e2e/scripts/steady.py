"""A steady training loop as the DDP tutorial writes it (DDP, SGD, a step every ~20 ms), that
runs until stopped; prints `ready` once its first step is done."""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    loss = model(torch.randn(8, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step == 1:
        print("ready", flush=True)
    time.sleep(0.02)
