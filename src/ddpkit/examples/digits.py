"""The example `ddpkit demo` runs: classify handwritten digits with ddpkit's API.

Real data, no download: the UCI digits set (1,797 8x8 images) ships inside ddpkit. Runs the same
on a laptop CPU (`python -m ddpkit.examples.digits`), one GPU, or many
(`ddpkit run -n gpu -m ddpkit.examples.digits`). With --checkpoint it saves its whole state every
epoch (s.save_state) and resumes where it was (s.load_state), after a crash with `ddpkit run
--max-restarts`, or after Ctrl+C/SIGTERM, on which it saves and stops.
"""

from __future__ import annotations

import argparse
import gzip
import os
import time
from importlib import resources

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 64] scaled to 0..1, labels [N]) from the bundled csv."""
    raw = resources.files("ddpkit.data").joinpath("digits.csv.gz").read_bytes()
    rows = [line.split(",") for line in gzip.decompress(raw).decode().splitlines() if line]
    values = torch.tensor([[int(v) for v in row] for row in rows], dtype=torch.float32)
    return values[:, :64] / 16.0, values[:, 64].long()


def split(
    images: torch.Tensor, labels: torch.Tensor, held_out: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - held_out))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--checkpoint", default=None, help="save and resume the state here")
    parser.add_argument(
        "--fail-at-epoch",
        type=int,
        default=None,
        help="rank 1 crashes at this epoch on the first attempt (to try --max-restarts)",
    )
    args = parser.parse_args()

    with ddpkit.setup(seed=0) as s:
        train_set, test_set = split(*load_digits())
        model = s.wrap(build_model())
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        train = s.loader(train_set, args.batch_size, shuffle=True, to_device=True)
        test = s.loader(test_set, 256, eval=True)
        s.print(
            f"digits: {len(train_set)} train / {len(test_set)} held-out images, "
            f"{s.world_size} rank(s), backend {s.backend}, device {s.device}"
        )
        # a first run starts fresh; a restarted one (--max-restarts) continues where it was
        if args.checkpoint and s.load_state(
            args.checkpoint, model=model, optimizer=opt, loader=train
        ):
            s.print(f"resumed from {args.checkpoint} at epoch {train.epoch}")
        seen, started = 0, time.perf_counter()
        while train.epoch < args.epochs:
            epoch = train.epoch
            if (
                epoch == args.fail_at_epoch
                and s.rank == min(1, s.world_size - 1)
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            ):
                raise RuntimeError(f"planted failure at epoch {epoch} (--fail-at-epoch)")
            model.train()
            total, batches = 0.0, 0
            for x, y in s.progress(train, desc=f"epoch {epoch}"):
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, batches, seen = total + loss.item(), batches + 1, seen + len(y)
            mean_loss = s.reduce(total / max(batches, 1))
            s.print(f"epoch {epoch}: train loss {mean_loss:.4f}")
            if args.checkpoint:
                s.save_state(args.checkpoint, model=model, optimizer=opt, loader=train)
            if s.stop_requested:  # Ctrl+C, SIGTERM or a scheduler's SIGUSR1: saved, leave
                s.print("stopping: the state is saved; run again to continue")
                return
        wall = time.perf_counter() - started
        correct, count = evaluate(s, model, test)
        samples_per_s = s.reduce(seen / max(wall, 1e-9), op="sum")
        s.print(f"held-out accuracy: {correct / count:.4f} ({int(correct)}/{int(count)})")
        s.print(
            f"summary: {s.world_size} rank(s), backend {s.backend}, "
            f"{samples_per_s:.0f} samples/s, {wall:.1f} s"
        )


@torch.no_grad()
def evaluate(
    s: ddpkit.Session, model: nn.Module, test: torch.utils.data.DataLoader
) -> tuple[float, float]:
    model.eval()
    correct = count = 0
    for x, y in test:
        pred = model(x.to(s.device)).argmax(dim=1).cpu()
        correct += int((pred == y).sum())
        count += len(y)
    totals = s.reduce({"correct": correct, "count": count}, op="sum")
    return totals["correct"], totals["count"]


if __name__ == "__main__":
    main()
