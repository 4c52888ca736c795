"""A training script in the shape of pytorch/examples' imagenet/main.py (an epoch loop calling
train() per epoch, `-j` workers, `-b` batch size, `--epochs`, a scheduler stepped per epoch,
the epoch kept in the checkpoint), stopped and resumed with ddpkit's save_state/load_state.
Dropout, a shuffled sharded loader whose workers augment with torch's RNG, SGD with momentum,
StepLR. Every rank prints every step's loss:
`loss rank R epoch E step S = <exact value>`.

    ddpkit run -n 4 examples_style.py STATE [-j 2] [--save-every N] [--sleep S]

Each epoch is 5 steps at any world size (40 samples per rank, batch 8).
"""

import argparse
import sys
import time

import torch
import torch.nn as nn

import ddpkit

parser = argparse.ArgumentParser(description="resumable training")
parser.add_argument("state", help="folder of the training state")
parser.add_argument("--epochs", default=3, type=int, metavar="N")
parser.add_argument("-j", "--workers", default=2, type=int, metavar="N")
parser.add_argument("-b", "--batch-size", default=8, type=int, metavar="N")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--save-every", default=0, type=int, help="save the state every N steps")
parser.add_argument("--sleep", default=0.0, type=float, help="seconds per step")


class Augmented(torch.utils.data.Dataset):
    """Fixed points; each read adds noise and flips at random (the augmentation)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.randn(16)
        if torch.rand(()) < 0.5:
            x = -x.flip(0)
        return x, self.y[i]


def train(train_loader, model, criterion, optimizer, epoch, meta, s, args, to_save):
    model.train()
    for images, target in train_loader:
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meta["step"] += 1
        meta["epoch"] = epoch
        print(f"loss rank {s.rank} epoch {epoch} step {meta['step']} = {loss.item()!r}", flush=True)
        if args.save_every and meta["step"] % args.save_every == 0:
            s.save_state(args.state, **to_save)
        if s.stop_requested:
            s.save_state(args.state, **to_save)
            s.print(f"stopped at step {meta['step']}, state saved", flush=True)
            sys.exit(0)
        time.sleep(args.sleep)


def main():
    args = parser.parse_args()
    with ddpkit.setup(seed=1) as s:
        model = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.ReLU(),
            nn.Linear(64, 2),
        )  # fmt: skip
        model = s.wrap(model)
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        dataset = Augmented(40 * s.world_size)
        train_loader = s.loader(dataset, batch_size=args.batch_size, num_workers=args.workers)
        meta = {"epoch": 0, "step": 0}
        to_save = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        to_save.update(loader=train_loader, meta=meta)
        if s.load_state(args.state, **to_save):
            s.print(f"resumed at step {meta['step']} (epoch {meta['epoch']})", flush=True)
        for epoch in range(meta["epoch"], args.epochs):
            train(train_loader, model, criterion, optimizer, epoch, meta, s, args, to_save)
            scheduler.step()
        s.print("finished", flush=True)


if __name__ == "__main__":
    main()
