"""Two graphed DDP steps, then rank 1 stops calling it: rank 0's replay waits in the
all-reduce until the hang watch names it."""

import time

import torch
from torch import nn

import ddpkit

with ddpkit.setup(graphs=True) as s:
    model = s.wrap(nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(model.parameters(), capturable=True)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    x = torch.randn(64, 1024, device=s.device)
    graphed = s.graph(step, x, model=model, optimizer=opt)
    for i in range(3):
        if i == 2:
            print("stall", flush=True)
            if s.rank == 1:
                time.sleep(600)  # @stuck
        graphed(x)  # @replay
