"""A training loop through s.fit, where rank 1 (argv --heavy) needs a workspace that grows with
the batch: at micro-batch 32 it asks for more memory than the host has (the CPU allocator
refuses: a real out-of-memory error), at 16 it fits. Every step prints every rank's loss:
`loss rank R step S = <exact value>`.

    ddpkit run -n 3 fits_the_batch.py STATE [--micro N] [--steps 8] [--stop-after K]
"""

import argparse
import sys

import psutil
import torch
from torch import nn

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("state")
parser.add_argument("--micro", type=int, default=None)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--stop-after", type=int, default=0)
parser.add_argument("--heavy", type=int, default=1)
args = parser.parse_args()

RAM = psutil.virtual_memory().total


class Points(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


with ddpkit.setup(seed=0) as s:
    model = s.wrap(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fit = s.fit(model, opt, micro_batch=args.micro)
    loader = s.loader(Points(), batch_size=32)
    progress = {"step": 0}
    s.load_state(args.state, model=model, optimizer=opt, fit=fit, loader=loader, progress=progress)
    # the rank's workspace per sample: at 32 samples rank `heavy`'s is 1.6x the host's memory
    per_sample = RAM // 20 if s.rank == args.heavy else RAM // 80

    def loss_fn(x, y):
        workspace = torch.empty(len(x) * per_sample, dtype=torch.uint8)  # never touched
        del workspace
        return nn.functional.cross_entropy(model(x), y)

    while progress["step"] < args.steps:
        for x, y in loader:
            loss = fit.step(loss_fn, x, y)
            progress["step"] += 1
            print(f"loss rank {s.rank} step {progress['step']} = {loss.item()!r}", flush=True)
            if progress["step"] == args.stop_after:
                s.save_state(
                    args.state,
                    model=model,
                    optimizer=opt,
                    fit=fit,
                    loader=loader,
                    progress=progress,
                )
                sys.exit(0)
            if progress["step"] >= args.steps:
                break
