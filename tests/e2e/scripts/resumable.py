"""A training run that can be stopped and resumed: dropout, a shuffled loader whose 2 workers
augment each sample with torch's RNG, SGD with momentum, a step LR schedule. Prints every
step's loss on every rank as `loss rank R epoch E step S = <exact value>`.

    ddpkit run -n 2 resumable.py STATE_DIR [--save-every N] [--epochs 3] [--sleep S]
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

import ddpkit


class Noisy(torch.utils.data.Dataset):
    """256 fixed points; each read adds noise and a random flip (the augmentation)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 16, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.randn(16)
        if torch.rand(()) < 0.5:
            x = -x.flip(0)
        return x, self.y[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("state")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--deterministic", action="store_true", help="GPU kernels too")
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    with ddpkit.setup(seed=1) as s:
        model = s.wrap(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        loader = s.loader(Noisy(), batch_size=16, num_workers=2, to_device=True)
        progress = {"step": 0}
        if s.load_state(
            args.state,
            model=model,
            optimizer=opt,
            scheduler=sched,
            loader=loader,
            progress=progress,
        ):
            s.print(f"resumed at step {progress['step']}", flush=True)
        while loader.epoch < args.epochs:
            epoch = loader.epoch
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                progress["step"] += 1
                print(
                    f"loss rank {s.rank} epoch {epoch} step {progress['step']} = {loss.item()!r}",
                    flush=True,
                )
                if args.save_every and progress["step"] % args.save_every == 0:
                    s.save_state(
                        args.state,
                        model=model,
                        optimizer=opt,
                        scheduler=sched,
                        loader=loader,
                        progress=progress,
                    )
                if s.stop_requested:
                    s.save_state(
                        args.state,
                        model=model,
                        optimizer=opt,
                        scheduler=sched,
                        loader=loader,
                        progress=progress,
                    )
                    s.print(f"stopped at step {progress['step']}, state saved", flush=True)
                    sys.exit(0)
                time.sleep(args.sleep)
        s.print("finished", flush=True)


if __name__ == "__main__":
    main()
