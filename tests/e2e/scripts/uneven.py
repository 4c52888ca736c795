"""A training loop as the PyTorch DDP tutorial writes it (init_process_group, DDP, a
DistributedSampler, no ddpkit in it), whose rank 1 is slowed on purpose, in phases of
--phase steps each (the same step on every rank), named on the command line in order:

    even          every rank alike
    data          rank 1's dataset sleeps in __getitem__ (its loader is slow)
    compute:F     rank 1's forward does extra matmuls: its compute takes F times as long
    wait:F        rank 1's forward sleeps as long instead (a lock, a file): as slow, idle
    hold          rank 1 prints `hold` and runs as `even` (a test slows it from outside)

Each phase prints `phase NAME` on rank 0 when it starts. Every step also sleeps --io seconds on
every rank (as if waiting on a file), so the job is light on a small machine.

    ddpkit run -n 3 uneven.py even data even compute:1.5 --phase 300
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("phases", nargs="+")
parser.add_argument("--phase", type=int, default=300, help="steps per phase")
parser.add_argument("--io", type=float, default=0.02, help="seconds each step sleeps")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--hidden", type=int, default=256, help="width of the hidden layer")
args = parser.parse_args()

state = {"phase": "even"}


class Points(Dataset):
    def __init__(self, rank):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(100_000, 64, generator=g)
        self.y = torch.randint(0, 10, (100_000,), generator=g)
        self.rank = rank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.rank == 1 and state["phase"] == "data":
            time.sleep(0.001)  # a slow disk
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
            nn.Linear(args.hidden, 10),
        )  # fmt: skip
        self.extra = 0.0  # seconds of extra work per forward (the compute fault)
        self.idle = False  # the extra time is spent asleep (the wait fault)

    def forward(self, x):
        if self.extra and self.idle:
            time.sleep(self.extra)
        elif self.extra:
            until = time.perf_counter() + self.extra
            w = torch.randn(64, 64)
            while time.perf_counter() < until:
                w = torch.tanh(w @ w)  # extra matmuls
        return self.layers(x)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Points(rank)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data))
    own = []  # this rank's own time per step in the even phase, to size the compute fault
    sampler = loader.sampler
    for step, (x, y) in enumerate(batches(loader, sampler)):
        index = step // args.phase
        if index >= len(args.phases):
            break
        name, _, factor = args.phases[index].partition(":")
        if name != state["phase"]:
            state["phase"] = name
            if rank == 0:
                print(f"phase {args.phases[index]}", flush=True)
            if rank == 1 and name == "hold":
                print("hold", flush=True)
            slow = name in ("compute", "wait")
            extra = (float(factor) - 1) * statistics(own) if slow else 0.0
            net.extra, net.idle = (extra if rank == 1 else 0.0), name == "wait"
            if rank == 1 and extra:
                print(f"extra {extra * 1e3:.1f} ms per forward", flush=True)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        forward = time.perf_counter() - t0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.io)
        if name == "even" and len(own) < 200:
            own.append(3 * forward + args.io)  # forward, backward (about twice), the sleep
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


def batches(loader, sampler):
    """Epoch after epoch, until the phases are over."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def statistics(values):
    values = sorted(values) or [0.03]
    return values[len(values) // 2]


if __name__ == "__main__":
    main()
