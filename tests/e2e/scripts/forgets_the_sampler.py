"""A script that forgets s.loader: a plain shuffled DataLoader beside s.wrap, as a one-GPU
script has it. Under `ddpkit run -n 2` every rank trains on all 96 samples. `--fixed`: the same
with s.loader, and the whole data set evaluated on rank 0 alone."""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

s = ddpkit.setup(seed=0)
data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
fixed = "--fixed" in sys.argv
train_loader = s.loader(data, batch_size=4) if fixed else DataLoader(data, 4, shuffle=True)
val_loader = DataLoader(data, batch_size=16, shuffle=fixed)
model = s.wrap(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = 0
for epoch in range(2):
    for x, y in train_loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    if s.is_main:  # evaluated by rank 0 alone, gradients on: not the mistake
        val = sum(nn.functional.mse_loss(model(x), y).item() for x, y in val_loader)
        print(f"epoch {epoch}: {steps} steps, val loss {val:.3f}", flush=True)
