"""What s.loader's defaults cost per batch against torch's DataLoader, at num_workers=0 on an
in-memory dataset (the case where the loader's own time shows most): a plain indexed dataset,
and one that augments with torch, numpy and random (the case seeding is for). Interleaved
blocks, medians; the goal is at most 1.5x torch's time per batch.

Run: python benchmarks/loader_cost.py [--samples 4096] [--batch 32] [--blocks 31]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

import ddpkit


class InMemory(torch.utils.data.Dataset):
    """A tensor dataset in memory, as TensorDataset reads it."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 64), torch.randint(0, 10, (n,))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Augmented(InMemory):
    """The same rows with noise from torch, a flip from random and a scale from numpy."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(64)
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.9, 1.1)), self.y[i]


def per_batch(loader: DataLoader) -> float:
    """Seconds per batch of one pass."""
    began = time.perf_counter()
    n = sum(1 for _ in loader)
    return (time.perf_counter() - began) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=31)
    args = parser.parse_args()
    rows = []
    with ddpkit.setup() as s:
        for dataset in (InMemory(args.samples), Augmented(args.samples)):
            loaders = {
                "torch DataLoader": DataLoader(dataset, args.batch, shuffle=True),
                "s.loader (default)": s.loader(dataset, args.batch),
                "s.loader(seeded=False)": s.loader(dataset, args.batch, seeded=False),
            }
            times: dict[str, list[float]] = {name: [] for name in loaders}
            names = list(loaders)
            for block in range(args.blocks):
                # each block runs every loader once, in a rotating order (drift hits all alike)
                for name in names[block % 3 :] + names[: block % 3]:
                    times[name].append(per_batch(loaders[name]))
            base = times["torch DataLoader"]
            for name, seen in times.items():
                ratios = [t / b for t, b in zip(seen, base, strict=True)]
                rows.append(
                    (
                        type(dataset).__name__,
                        name,
                        statistics.median(seen) * 1e3,
                        statistics.median(ratios),
                        max(ratios) - min(ratios) if len(ratios) > 1 else 0.0,
                    )
                )
    print(f"torch {torch.__version__}, batch {args.batch}, num_workers=0, {args.blocks} blocks")
    print("x torch: the median of each block's ratio to torch's DataLoader in the same block")
    print(f"{'dataset':<10} {'loader':<24} {'ms/batch':>9} {'x torch':>8} {'spread':>7}")
    for dataset_name, name, ms, ratio, spread in rows:
        print(f"{dataset_name:<10} {name:<24} {ms:>9.3f} {ratio:>8.2f} {spread:>7.2f}")


if __name__ == "__main__":
    main()
