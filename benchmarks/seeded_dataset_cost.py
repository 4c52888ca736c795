"""What per-sample seeding costs (s.loader's seeded=True): the time to read every sample of a
dataset through the loader with and without it, for a cheap sample (a row of a tensor) and a
typical augmented one (a 3x64x64 crop and flip), 0 and 2 workers, interleaved runs, medians.

Run: python benchmarks/seeded_dataset_cost.py [--samples 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddpkit


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + 0.1 * torch.randn(16)


class Crops(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.image = torch.randn(3, 80, 80)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        top, left = torch.randint(0, 16, (2,)).tolist()
        crop = self.image[:, top : top + 64, left : left + 64]
        return crop.flip(2) if torch.rand(()) < 0.5 else crop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with ddpkit.setup() as s:
        print(f"{'dataset':<8} {'workers':>7} {'plain us/sample':>15} {'seeded':>9} {'cost':>8}")
        for name, data in (("rows", Rows(args.samples)), ("crops", Crops(args.samples))):
            for workers in (0, 2):
                times: dict[bool, list[float]] = {True: [], False: []}
                for i in range(args.repeat * 2):
                    seeded = i % 2 == 0
                    loader = s.loader(data, 64, seeded=seeded, num_workers=workers)
                    began = time.perf_counter()
                    for _ in loader:
                        pass
                    times[seeded].append((time.perf_counter() - began) / len(data) * 1e6)
                plain = statistics.median(times[False])
                seeded_us = statistics.median(times[True])
                print(
                    f"{name:<8} {workers:>7} {plain:>15.1f} {seeded_us:>9.1f} "
                    f"{seeded_us - plain:>+7.1f}us"
                )


if __name__ == "__main__":
    main()
