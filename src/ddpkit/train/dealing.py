"""One epoch's global order of samples, dealt to the ranks from any position in it, so that a
loader's place in an epoch means the same thing at every world size.

The order is torch's DistributedSampler's, exactly: a permutation of the dataset from
(seed + epoch) (or 0..N-1 without shuffling), padded with its own first indices to a multiple
of the world size (or, with drop_last, cut to one). Rank r takes positions r, r+W, r+2W, ...,
so global batch t (every rank's batch t) is positions [t*G, (t+1)*G) for a global batch G of
W x the per-rank batch. That makes a loader's place one number: the positions of the epoch's
order consumed by the whole job, `start + batches * batch * world`.

Resumed at another world size M, the epoch keeps the order it began with (padded for the
world size it began at) and the rest, from the position reached, is dealt to M ranks the same
way; when the rest does not divide by M it is padded from the epoch's first indices (at most
M - 1 samples seen twice, as DistributedSampler pads) or, with drop_last, cut. Later epochs are
ordinary epochs at M. Evaluation (`even=False`) deals 0..N-1 without padding, each sample once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(
    length: int, world: int, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> list[int]:
    """The epoch's global order at `world` ranks: DistributedSampler's list before each rank
    takes its share."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(length, generator=generator).tolist()
    else:
        order = list(range(length))
    if drop_last and length % world:
        return order[: length // world * world]
    total = math.ceil(length / world) * world
    return _padded(order, total, order)


def _padded(rest: list[int], total: int, order: list[int]) -> list[int]:
    """`rest` made `total` long with the epoch's first indices (repeated if it must)."""
    missing = total - len(rest)
    if missing <= 0 or not order:
        return rest
    return rest + (order * math.ceil(missing / len(order)))[:missing]


class DealtSampler(Sampler[int]):
    """This rank's share of each epoch's global order. `resume_at(epoch, position, world)`
    makes the next pass of `epoch` start at `position` of the order that epoch began with at
    `world` ranks; every other pass is a whole epoch at this world size."""

    def __init__(
        self,
        length: int,
        rank: int,
        world: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        even: bool = True,
    ) -> None:
        self.length = length
        self.rank = rank
        self.world = world
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.even = even  # every rank the same count (training); else each sample once
        self.epoch = 0
        self.begun_at = world  # the world size the current epoch's order was made for
        self.start = 0  # the position of that order the current pass begins at
        self._resume: tuple[int, int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The next pass is `epoch`: from the resumed position if it is the resumed epoch."""
        self.epoch = epoch
        if self._resume is not None and self._resume[0] == epoch:
            _, self.start, self.begun_at = self._resume
        else:
            self.start, self.begun_at = 0, self.world
        self._resume = None

    def resume_at(self, epoch: int, position: int, world: int) -> None:
        self._resume = (epoch, position, world)

    def order(self) -> list[int]:
        """The current epoch's global order (the one its first pass began with)."""
        if not self.even:
            return list(range(self.length))
        return epoch_order(
            self.length, self.begun_at, self.seed, self.epoch, self.shuffle, self.drop_last
        )

    def rest(self) -> list[int]:
        """What the job has still to take of the current epoch, every rank's share together."""
        order = self.order()
        rest = order[self.start :]
        if not self.even or not rest or len(rest) % self.world == 0:
            return rest
        if self.drop_last:
            return rest[: len(rest) // self.world * self.world]
        return _padded(rest, math.ceil(len(rest) / self.world) * self.world, order)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rest()[self.rank :: self.world])

    def __len__(self) -> int:  # without making the order: DataLoader asks often
        begun = self.order_length(self.begun_at) if self.even else self.length
        rest = max(0, begun - self.start)
        if self.even and rest % self.world:
            rest = rest // self.world * self.world + (0 if self.drop_last else self.world)
        return max(0, (rest - self.rank + self.world - 1) // self.world)

    def order_length(self, world: int) -> int:
        """The length of an epoch's order made for `world` ranks."""
        if not self.even:
            return self.length
        if self.drop_last and self.length % world:
            return self.length // world * world
        return math.ceil(self.length / world) * world

    def epoch_length(self) -> int:
        """This rank's samples in a whole epoch at this world size."""
        whole = self.order_length(self.world)
        return (whole - self.rank + self.world - 1) // self.world
