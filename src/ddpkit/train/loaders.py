"""Data loading that shards across ranks, resumes exactly, and reproduces itself.

`make_loader` gives each rank its share of each epoch's global order (ddpkit.train.dealing:
DistributedSampler's order exactly, at world size 1 too, so every epoch's order comes from
(seed, epoch) alone), calls `set_epoch` on every new pass, and for evaluation (`eval=True`)
shards without padding so every sample is counted exactly once across ranks, uneven sizes
included.

Resume: the loader knows its epoch, how many batches of it were taken and what the whole job
consumed of the epoch's order (`resume_state()`); after `restore(...)` the next pass starts
there by dealing the *indices* left, so no skipped sample is ever read. At another world size
the rest of the epoch is dealt to the new ranks, and the per-rank batch is set to keep the
global batch where it divides (`keep_batch="global"`), else the per-rank batch is kept.

Reproducible samples: randomness inside `Dataset.__getitem__` is seeded per batch
(ddpkit.train.seeded_reads); the sampler hands each index to the dataset as (epoch, index), so
persistent workers see the epoch too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ddpkit.errors import CheckpointError
from ddpkit.train import rescue
from ddpkit.train.dealing import DealtSampler
from ddpkit.train.placement import Placement
from ddpkit.train.seeded_reads import SeededDataset
from ddpkit.train.seeding import mix


class EpochSampler(Sampler[Any]):
    """Wraps the rank's sampler: yields (epoch, index), starting `skip` indices in."""

    def __init__(self, inner: Sampler[int], seeded: bool) -> None:
        self.inner = inner  # a DealtSampler (s.loader's own) resumes itself; others by `skip`
        self.seeded = seeded
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch = getattr(self.inner, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        indices = islice(iter(self.inner), self.skip, None)  # indices only: nothing is read
        if not self.seeded:
            return indices
        return ((self.epoch, i) for i in indices)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)  # type: ignore[arg-type]


class EpochLoader(DataLoader):
    """A DataLoader that tells its sampler which epoch each new pass is, counts the batches
    it hands out, can resume mid-epoch (at another world size too), and moves batches to a
    device when asked.

    Where it stands is where a never-stopped loop stands: inside a pass (its iterator alive,
    even after the last batch, before the loop has seen the epoch end), or between passes (the
    pass ran out or its iterator was dropped: the next `iter()` starts the next epoch)."""

    _next = 0  # the epoch the next pass is
    to_device: torch.device | None = None
    keep_batch = "global"  # at another world size: keep the global batch where it divides
    world = 1  # this job's world size
    _taken = 0  # batches taken of the current epoch (before a resume too)
    _since = 0  # batches taken by the current pass
    _current = -1  # the epoch of the current pass
    _open: object | None = None  # the current pass, while its iterator lives
    _restored: dict[str, int] | None = None  # where the next pass resumes

    @property
    def epoch(self) -> int:
        """Inside a pass, the epoch of that pass (what the loop is in); between passes, the
        epoch the next pass will be, so `while train.epoch < epochs:` runs each epoch left
        once, resumed or not."""
        return self._current if self._open is not None else self._next

    @epoch.setter
    def epoch(self, value: int) -> None:  # as set_epoch: the epoch the next pass is
        self._next = int(value)

    @property
    def dealt(self) -> DealtSampler | None:
        """s.loader's own sampler, which knows the epoch's global order; None for a sampler
        the script gave (or an IterableDataset)."""
        inner = getattr(self.sampler, "inner", None)
        return inner if isinstance(inner, DealtSampler) else None

    def __iter__(self) -> Any:
        # lazy: an iterator made and dropped (tqdm's asyncio flavour makes one) starts nothing
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        """One pass: the next epoch (or the rest of a restored one). Each batch tells the
        launcher's hang doctor that this rank is making progress."""
        from ddpkit.rank.progress import beat

        restored, self._restored = self._restored, None
        epoch, skip = (restored["epoch"], restored["batches"]) if restored else (self._next, 0)
        sampler = self.sampler if isinstance(self.sampler, EpochSampler) else None
        if sampler is not None:
            sampler.set_epoch(epoch)  # a DealtSampler starts at its resumed position
            sampler.skip = 0 if self.dealt is not None else skip * (self.batch_size or 1)
        self._current, self._next, self._taken, self._since = epoch, epoch + 1, skip, 0
        token = self._open = object()
        try:
            batches = super().__iter__()
            while True:
                rescue.before_fetch(self)  # a step's boundary: what a peer's failure keeps
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                beat()
                self._taken += 1
                self._since += 1
                yield batch if self.to_device is None else _to(batch, self.to_device)
        finally:
            if self._open is token:  # not a newer pass started meanwhile
                self._open = None
            if sampler is not None:
                sampler.skip = 0

    def resume_state(self) -> dict[str, int]:
        """Where this loader is: inside a pass, its epoch and the batches taken of it (all of
        them after the last batch, until the loop sees the epoch end); between passes, the
        next epoch and 0. With s.loader's own sampler also the position in the epoch's global
        order (what the whole job consumed), which follows a change of world size."""
        if self._restored is not None:
            return dict(self._restored)
        if self._open is not None:
            state = {"epoch": self._current, "batches": self._taken}
        else:
            state = {"epoch": self._next, "batches": 0}
        dealt = self.dealt
        if dealt is None:
            return state
        if self._open is not None:
            consumed = dealt.start + self._since * (self.batch_size or 1) * dealt.world
            position, begun_at = min(consumed, dealt.order_length(dealt.begun_at)), dealt.begun_at
        else:
            position, begun_at = 0, dealt.world
        return {
            **state,
            "position": position,
            "begun_at": begun_at,
            "world": dealt.world,
            "batch_size": int(self.batch_size or 1),
            "length": dealt.length,
        }

    def check_restore(self, state: dict[str, int], name: str = "loader") -> None:
        """Raise CheckpointError if `state` cannot be restored here; changes nothing."""
        dealt = self.dealt
        saved_world = int(state.get("world", self.world))
        if dealt is None:
            if saved_world != self.world:
                raise CheckpointError(
                    f"the state's {name!r} was saved by {saved_world} ranks and this job has "
                    f"{self.world}; its position cannot follow: it was made with the script's "
                    "own sampler (or over an IterableDataset), whose order ddpkit cannot know",
                    fix=f"let s.loader shard (leave out sampler=) or load without {name!r}: "
                    "s.load_state(path, model=..., optimizer=...) starts its epoch over",
                )
            return
        length = state.get("length")
        if length is not None and int(length) != dealt.length:
            raise CheckpointError(
                f"the state's {name!r} was over a dataset of {int(length)} samples; this one "
                f"has {dealt.length}: its place in the epoch means nothing here",
                fix=f"resume with the dataset it was saved with, or load without {name!r} "
                "(its epoch starts over)",
            )
        left = self._left(state, saved_world)
        if dealt.even and 0 < left < self.world:
            raise CheckpointError(
                f"the state's {name!r} has {_count(left, 'sample')} of epoch {int(state['epoch'])} "
                f"left and this job has {self.world} ranks: every rank needs one",
                fix=f"resume with at most {left} ranks, or load without {name!r} (the epoch "
                "starts over)",
            )

    def _left(self, state: dict[str, int], saved_world: int) -> int:
        dealt = self.dealt
        assert dealt is not None
        begun_at = int(state.get("begun_at", saved_world))
        return max(0, dealt.order_length(begun_at) - self._position(state, saved_world))

    def _position(self, state: dict[str, int], saved_world: int) -> int:
        if "position" in state:
            return int(state["position"])
        # a state of ddpkit before positions: every pass began at the epoch's start
        return int(state["batches"]) * int(self.batch_size or 1) * saved_world

    def restore(self, state: dict[str, int]) -> str | None:
        """Stand where resume_state() was read: the next pass continues that epoch after what
        the job had consumed (nothing when all of it was), at this world size. Returns what
        changed, in words, when the world size did (None otherwise)."""
        self.check_restore(state)
        epoch, batches = int(state["epoch"]), int(state["batches"])
        self._next, self._open = epoch, None
        dealt = self.dealt
        if dealt is None:
            self._restored = {"epoch": epoch, "batches": batches}
            return None
        saved_world = int(state.get("world", self.world))
        position = self._position(state, saved_world)
        begun_at = int(state.get("begun_at", saved_world))
        saved_batch = int(state.get("batch_size", self.batch_size or 1))
        said = None
        if saved_world != self.world:
            said = self._follow(saved_batch, saved_world, epoch, state)
        dealt.resume_at(epoch, position, begun_at)
        self._restored = {
            "epoch": epoch,
            "batches": batches,
            "position": position,
            "begun_at": begun_at,
            "world": self.world,
            "batch_size": int(self.batch_size or 1),
            "length": dealt.length,
        }
        return said

    def _follow(self, was: int, saved: int, epoch: int, state: dict[str, int]) -> str:
        """The per-rank batch at this world size, from the per-rank batch `was` at `saved`
        ranks, set; what it means, in words."""
        global_batch = was * saved
        if self.keep_batch == "global" and global_batch % self.world == 0:
            self._set_batch_size(global_batch // self.world)
            batch = f"global batch {global_batch} kept: {self.batch_size} per rank" + (
                f" (was {was})" if was != self.batch_size else ""
            )
        else:
            why = (
                f"{global_batch} does not divide by {self.world}"
                if self.keep_batch == "global"
                else "keep_batch='per_rank'"
            )
            self._set_batch_size(was)
            now = was * self.world
            batch = (
                f"global batch {now} (was {global_batch}: {why}); {was} per rank: a learning "
                f"rate tuned for {global_batch} may need scaling by {now}/{global_batch}"
            )
        left = self._left(state, saved)
        dealt = self.dealt
        assert dealt is not None
        if left == dealt.order_length(int(state.get("begun_at", saved))):
            return f"starts epoch {epoch}; {batch}"
        return f"continues epoch {epoch} in the same order, {_count(left, 'sample')} left; {batch}"

    def _set_batch_size(self, size: int) -> None:
        if self.batch_sampler is not None and hasattr(self.batch_sampler, "batch_size"):
            self.batch_sampler.batch_size = size
        object.__setattr__(self, "batch_size", size)  # DataLoader refuses a plain set

    def __len__(self) -> int:
        dealt = self.dealt
        if dealt is not None:
            n = dealt.epoch_length()
        elif isinstance(self.sampler, EpochSampler):
            n = len(self.sampler.inner)  # type: ignore[arg-type]
        else:
            return super().__len__()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)  # type: ignore[operator]


def make_loader(
    dataset: Dataset,
    batch_size: int,
    place: Placement,
    shuffle: bool = True,
    eval: bool = False,
    to_device: bool = False,
    seeded: bool = True,
    keep_batch: str = "global",
    **kwargs: Any,
) -> EpochLoader:
    """A DataLoader for this rank's share of `dataset`; kwargs go to DataLoader."""
    rank, world_size, seed = place.rank, place.world_size, place.seed
    if keep_batch not in ("global", "per_rank"):
        from ddpkit.errors import ConfigError

        raise ConfigError(
            f"s.loader(keep_batch={keep_batch!r}) is not a choice",
            fix="keep_batch='global' (the default: the global batch stays after a change of "
            "world size where it divides) or 'per_rank'",
        )
    shuffle = shuffle and not eval
    drop_last = bool(kwargs.pop("drop_last", False))
    sampler = kwargs.pop("sampler", None)
    iterable = isinstance(dataset, IterableDataset)
    if sampler is None and not iterable:
        sampler = DealtSampler(
            len(dataset),  # type: ignore[arg-type]
            rank,
            world_size,
            seed,
            shuffle=shuffle,
            drop_last=drop_last and not eval,
            even=not eval,
        )
    seeded = seeded and not iterable
    if sampler is not None:
        kwargs["sampler"] = EpochSampler(sampler, seeded)
    if seeded:
        dataset = SeededDataset(dataset, seed)
    kwargs.setdefault("generator", torch.Generator().manual_seed(mix(seed, rank)))
    kwargs["worker_init_fn"] = _seed_worker(kwargs.get("worker_init_fn"))
    loader = EpochLoader(dataset, batch_size=batch_size, drop_last=drop_last, **kwargs)
    loader.to_device = place.device if to_device else None
    loader.keep_batch, loader.world = keep_batch, world_size
    return loader


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        moved = [_to(v, device) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch


def _seed_worker(user_fn: Callable[[int], None] | None) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        # torch already gives each worker torch.initial_seed() = base + id, and the base comes
        # from the rank-mixed generator; carry it to random and numpy, which torch leaves alone.
        worker_seed = torch.initial_seed() % 2**32
        random.seed(worker_seed)
        np.random.seed(worker_seed % 2**32)
        if user_fn is not None:
            user_fn(worker_id)

    return init
