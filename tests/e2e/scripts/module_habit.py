"""The guide's habit of `model.module` for the bare model, in a script that uses s.wrap: fine
under DDP, and at world size 1 (`python module_habit.py`) s.wrap gives back the model itself."""

import torch
from torch import nn

import ddpkit

s = ddpkit.setup(seed=0)
model = s.wrap(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 4)).pow(2).mean()
loss.backward()
opt.step()
torch.save(model.module.state_dict(), "model.pt")
print("saved", flush=True)
