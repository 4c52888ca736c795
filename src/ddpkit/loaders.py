"""Data loading that shards across ranks without the usual traps.

`make_loader` gives each rank its share (DistributedSampler for training), calls `set_epoch`
on every new pass so each epoch is shuffled differently, seeds workers differently on every
rank, and for evaluation (`eval=True`) shards without padding so every sample is counted
exactly once across ranks, uneven sizes included.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class EvalSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ...: disjoint, complete, no padding."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class EpochLoader(DataLoader):
    """A DataLoader that tells its sampler which epoch each new pass is."""

    epoch = 0

    def __iter__(self) -> Any:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        self.epoch += 1
        return _beating(super().__iter__())


def _beating(batches: Iterator[Any]) -> Iterator[Any]:
    """Each batch tells the launcher's hang doctor that this rank is making progress."""
    from ddpkit.rank.progress import beat

    for batch in batches:
        beat()
        yield batch


def make_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    shuffle: bool = True,
    eval: bool = False,  # noqa: A002 - the public API's word
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader for this rank's share of `dataset`; kwargs go to DataLoader."""
    shuffle = shuffle and not eval
    drop_last = bool(kwargs.pop("drop_last", False))
    sampler = kwargs.pop("sampler", None)
    if sampler is None and eval and world_size > 1:
        sampler = EvalSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
    elif sampler is None and world_size > 1:
        sampler = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
    if sampler is not None:
        kwargs["sampler"] = sampler
    else:
        kwargs["shuffle"] = shuffle
    kwargs.setdefault("generator", torch.Generator().manual_seed(_mix(seed, rank)))
    kwargs["worker_init_fn"] = _seed_worker(kwargs.get("worker_init_fn"))
    return EpochLoader(dataset, batch_size=batch_size, drop_last=drop_last, **kwargs)


def _mix(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + rank * 7919 + 17) % (2**63)


def _seed_worker(user_fn: Callable[[int], None] | None) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        # torch already gives each worker torch.initial_seed() = base + id, and the base comes
        # from the rank-mixed generator; carry it to random and numpy, which torch leaves alone.
        worker_seed = torch.initial_seed() % 2**32
        random.seed(worker_seed)
        try:
            import numpy as np

            np.random.seed(worker_seed)
        except ImportError:
            pass
        if user_fn is not None:
            user_fn(worker_id)

    return init
