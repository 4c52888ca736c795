"""Gradient accumulation without needless all-reduces: gradients are synchronised across ranks
only on the last of every 4 micro-steps (DDP's no_sync on the others).

    ddpkit run -n 2 examples/accumulate.py
"""

import torch
from torch import nn

import ddpkit
from ddpkit.examples.digits import load_digits, split

train_set, _ = split(*load_digits())
loss_fn = nn.CrossEntropyLoss()

with ddpkit.setup(seed=0) as s:
    model = s.wrap(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = s.loader(train_set, batch_size=8, to_device=True)
    for epoch in range(3):
        for x, y in loader:
            with s.accumulate(model, every=4) as step:  # no_sync on 3 of every 4 micro-steps
                loss = loss_fn(model(x), y)
                (loss / 4).backward()
            if step.sync:
                opt.step()
                opt.zero_grad()
        s.print(f"epoch {epoch}: last loss {s.reduce(loss.item()):.4f}")
