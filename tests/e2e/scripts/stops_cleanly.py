"""The docs' pattern with a cheap step (the case where a lost signal hid best): read
`s.stop_requested` every step, save, leave. Checkpoints every 50 steps too, reading the flag a
second time in the same step, as people write it. The step is a small model's, its loss
averaged across ranks for the log (no DDP: the stop is the point, and DDP's first wrap costs
each rank two seconds of imports).

    ddpkit run -n 3 stops_cleanly.py STATE [--steps 100000]

Prints `step N loss L` on rank 0 every 20 steps, and `rank R saved at step N` on every rank.
"""

import argparse
import sys

import torch
from torch import nn

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("state")
parser.add_argument("--steps", type=int, default=100_000)
args = parser.parse_args()

with ddpkit.setup(seed=0) as s:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = {"step": 0}
    s.load_state(args.state, model=model, optimizer=opt, progress=progress)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    while progress["step"] < args.steps:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress["step"] += 1
        mean_loss = s.reduce(loss.item())
        if progress["step"] % 20 == 0:
            s.print(f"step {progress['step']} loss {mean_loss:.4f}", flush=True)
        if progress["step"] % 50 == 0 or s.stop_requested:
            s.save_state(args.state, model=model, optimizer=opt, progress=progress)
        if s.stop_requested:
            print(f"rank {s.rank} saved at step {progress['step']}", flush=True)
            sys.exit(0)
