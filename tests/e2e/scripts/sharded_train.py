"""A sharded training loop (s.wrap(model, shard=True): FSDP2) that can stall or crash on rank 1
inside a step, in the middle of its forward:

    ddpkit run -n 2 sharded_train.py [--stall-at STEP | --crash-at STEP]
"""

import argparse
import time

import torch
from torch import nn

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--stall-at", type=int, default=-1)
parser.add_argument("--crash-at", type=int, default=-1)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
state = {"step": 0, "rank": 0}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        if state["rank"] == 1 and state["step"] == args.stall_at:
            time.sleep(3600)  # the stall: in the middle of the forward
        if state["rank"] == 1 and state["step"] == args.crash_at:
            raise RuntimeError(f"planted failure in a sharded step {state['step']}")
        return x + self.ff(x)


with ddpkit.setup(seed=0) as s:
    state["rank"] = s.rank
    model = s.wrap(nn.Sequential(*[Block() for _ in range(4)], nn.Linear(32, 4)), shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        state["step"] = step
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    s.print("done", flush=True)
