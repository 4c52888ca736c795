"""An Accelerate script as its docs write one: Accelerator(), prepare(), accelerator.backward.
Under `ddpkit run -n 2` (or torchrun, or `accelerate launch`) it trains on 2 CPU ranks.

    ddpkit run -n 2 accelerate_train.py [--stall-at STEP | --crash-at STEP]

--stall-at: rank 1 sleeps before its forward at that step; --crash-at: rank 1 raises there.
"""

import argparse
import time

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stall-at", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        for step, (inputs, targets) in enumerate(loader):
            if accelerator.process_index == 1 and step == args.stall_at:
                time.sleep(3600)  # the stall: rank 1 never reaches its forward
            if accelerator.process_index == 1 and step == args.crash_at:
                raise ValueError(f"bad batch {step} on purpose")
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        mean = accelerator.gather(loss.detach()).mean()
        accelerator.print(f"epoch {epoch}: loss {mean.item():.4f}")
    accelerator.print("trained")


if __name__ == "__main__":
    main()
