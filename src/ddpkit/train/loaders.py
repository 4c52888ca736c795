"""Data loading that shards across ranks, resumes exactly, and reproduces itself.

`make_loader` gives each rank its share (a DistributedSampler for training, at world size 1
too, so every epoch's order comes from (seed, epoch) alone), calls `set_epoch` on every new
pass, and for evaluation (`eval=True`) shards without padding so every sample is counted
exactly once across ranks, uneven sizes included.

Resume: the loader knows its epoch and how many batches of it were taken
(`resume_state()`); after `restore(...)` the next pass starts at the next batch of that epoch by
skipping sample *indices*, so no skipped sample is ever read.

Reproducible samples: randomness inside `Dataset.__getitem__` (augmentation with torch, numpy
or `random`) is seeded once per batch from (seed, epoch, the batch's first index, its size),
so batch b of epoch e is the same whichever worker reads it, whatever `num_workers` is,
resumed or not. The sampler hands each index to the dataset as (epoch, index), so persistent
workers see the epoch too; in the main process the random states around the batch are saved
and put back, so the training loop's own randomness is not disturbed. Seeding per batch, not
per sample, keeps the loader within 1.5x of torch's DataLoader on an in-memory dataset
(benchmarks/results/cpu-loader_cost.txt); the time it takes is counted as the host's, never
as the user's data time.
"""

from __future__ import annotations

import ctypes
import random
import sys
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from ddpkit.rank import steps
from ddpkit.train.placement import Placement


class EvalSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ...: disjoint, complete, no padding."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class EpochSampler(Sampler[Any]):
    """Wraps the rank's sampler: yields (epoch, index), starting `skip` indices in."""

    def __init__(self, inner: Sampler[int], seeded: bool) -> None:
        self.inner = inner
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


class SeededDataset(Dataset):
    """dataset[(epoch, i)] and each batch of such keys read with every random generator
    seeded for the read, and put back after it: a batch from (seed, epoch, its first index,
    its size), a lone sample from (seed, epoch, i)."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        epoch, index = key
        return self._read(_mix(self.seed, epoch, index), [index], single=True)

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """A whole batch (torch's fetcher asks for batches this way): one seeding per batch,
        which is what keeps the loader's cost near torch's own."""
        epoch, first = keys[0]
        return self._read(_mix(self.seed, epoch, first, len(keys)), [i for _, i in keys])

    def _read(self, seed: int, indices: list[int], single: bool = False) -> Any:
        if _worker_info() is not None:
            # a DataLoader worker: nothing else draws from its generators, no need to put back
            _seed_all(seed)
            return self._fetch(indices, single)
        began = time.perf_counter()
        saved = _save_generators()
        _seed_all(seed)
        own = time.perf_counter() - began
        try:
            return self._fetch(indices, single)
        finally:
            began = time.perf_counter()
            _restore_generators(saved)
            _not_data(own + time.perf_counter() - began)

    def _fetch(self, indices: list[int], single: bool) -> Any:
        dataset = self.dataset
        if single:
            return dataset[indices[0]]
        own = getattr(dataset, "__getitems__", None)
        return own(indices) if own is not None else [dataset[i] for i in indices]

    def __getattr__(self, name: str) -> Any:  # the user's dataset's own attributes
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class EpochLoader(DataLoader):
    """A DataLoader that tells its sampler which epoch each new pass is, counts the batches
    it hands out, can resume mid-epoch, and moves batches to a device when asked.

    Where it stands is where a never-stopped loop stands: inside a pass (its iterator alive,
    even after the last batch, before the loop has seen the epoch end), or between passes (the
    pass ran out or its iterator was dropped: the next `iter()` starts the next epoch)."""

    _next = 0  # the epoch the next pass is
    to_device: torch.device | None = None
    _taken = 0  # batches taken of the current pass
    _current = -1  # the epoch of the current pass
    _open: object | None = None  # the current pass, while its iterator lives
    _restored: tuple[int, int] | None = None  # (epoch, batches taken) the next pass resumes

    @property
    def epoch(self) -> int:
        """Inside a pass, the epoch of that pass (what the loop is in); between passes, the
        epoch the next pass will be, so `while train.epoch < epochs:` runs each epoch left
        once, resumed or not."""
        return self._current if self._open is not None else self._next

    @epoch.setter
    def epoch(self, value: int) -> None:  # as set_epoch: the epoch the next pass is
        self._next = int(value)

    def __iter__(self) -> Any:
        # lazy: an iterator made and dropped (tqdm's asyncio flavour makes one) starts nothing
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        """One pass: the next epoch (or the rest of a restored one). Each batch tells the
        launcher's hang doctor that this rank is making progress."""
        from ddpkit.rank.progress import beat

        epoch, skip = self._restored or (self._next, 0)
        self._restored = None
        sampler = self.sampler if isinstance(self.sampler, EpochSampler) else None
        if sampler is not None:
            sampler.set_epoch(epoch)
            sampler.skip = skip * (self.batch_size or 1)
        self._current, self._next, self._taken = epoch, epoch + 1, skip
        token = self._open = object()
        try:
            for batch in super().__iter__():
                beat()
                self._taken += 1
                yield batch if self.to_device is None else _to(batch, self.to_device)
        finally:
            if self._open is token:  # not a newer pass started meanwhile
                self._open = None
            if sampler is not None:
                sampler.skip = 0

    def resume_state(self) -> dict[str, int]:
        """Where this loader is: inside a pass, its epoch and the batches taken of it (all of
        them after the last batch, until the loop sees the epoch end); between passes, the
        next epoch and 0."""
        if self._open is not None:
            return {"epoch": self._current, "batches": self._taken}
        if self._restored is not None:
            return {"epoch": self._restored[0], "batches": self._restored[1]}
        return {"epoch": self._next, "batches": 0}

    def restore(self, state: dict[str, int]) -> None:
        """Stand where resume_state() was read: the next pass continues that epoch after the
        batches taken (and yields nothing when all were taken)."""
        self._restored = (int(state["epoch"]), int(state["batches"]))
        self._next = self._restored[0]
        self._open = None

    def __len__(self) -> int:
        if isinstance(self.sampler, EpochSampler):
            whole = self.sampler.inner
            n = len(whole)  # type: ignore[arg-type]
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)  # type: ignore[operator]
        return super().__len__()


def make_loader(
    dataset: Dataset,
    batch_size: int,
    place: Placement,
    shuffle: bool = True,
    eval: bool = False,
    to_device: bool = False,
    seeded: bool = True,
    **kwargs: Any,
) -> EpochLoader:
    """A DataLoader for this rank's share of `dataset`; kwargs go to DataLoader."""
    rank, world_size, seed = place.rank, place.world_size, place.seed
    shuffle = shuffle and not eval
    drop_last = bool(kwargs.pop("drop_last", False))
    sampler = kwargs.pop("sampler", None)
    iterable = isinstance(dataset, IterableDataset)
    if sampler is None and not iterable:
        if eval:
            sampler = EvalSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
        else:
            sampler = DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
            )
    seeded = seeded and not iterable
    if sampler is not None:
        kwargs["sampler"] = EpochSampler(sampler, seeded)
    if seeded:
        dataset = SeededDataset(dataset, seed)
    kwargs.setdefault("generator", torch.Generator().manual_seed(_mix(seed, rank)))
    kwargs["worker_init_fn"] = _seed_worker(kwargs.get("worker_init_fn"))
    loader = EpochLoader(dataset, batch_size=batch_size, drop_last=drop_last, **kwargs)
    loader.to_device = place.device if to_device else None
    return loader


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        moved = [_to(v, device) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch


def _seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # the CPU generator (torch.manual_seed: 100x)
    random.seed(seed)
    _numpy_seed(seed)


def _mix(*parts: int) -> int:
    value = 17
    for part in parts:
        value = (value * 1_000_003 + int(part) * 7919 + 1) % (2**63)
    return value


def _numpy_seed(seed: int) -> None:
    np.random.seed(seed % 2**32)


_worker_info = torch.utils.data.get_worker_info

# ddpkit's own time inside a DataLoader's `__next__` (saving, seeding and restoring generators):
# the step timing counts it as the host's, not as waiting for data
_not_data = steps.not_data


def _save_generators() -> tuple[Any, Any, Any]:
    return torch.default_generator.get_state(), _PYTHON.save(), _NUMPY.save()


def _restore_generators(saved: tuple[Any, Any, Any]) -> None:
    torch.default_generator.set_state(saved[0])
    _PYTHON.restore(saved[1])
    _NUMPY.restore(saved[2])


class _StateCopy:
    """A generator's state saved and put back by copying its bytes, where a check at first use
    shows that the copy round-trips (else the generator's own get/set state, ~5-10x slower).
    `address()` and `size` say where the state lies; `slow_save`/`slow_restore` are the
    generator's own API."""

    size = 0

    def __init__(self) -> None:
        self.fast: bool | None = None  # decided at first use

    def address(self) -> int | None:
        raise NotImplementedError

    def slow_save(self) -> Any:
        raise NotImplementedError

    def slow_restore(self, state: Any) -> None:
        raise NotImplementedError

    def draw(self) -> None:
        """Draw enough to change every word of the state."""
        raise NotImplementedError

    def _check(self) -> bool:
        address = self.address()
        if address is None:
            return False
        before = self.slow_save()
        try:
            copy = ctypes.string_at(address, self.size)
            self.draw()
            ctypes.memmove(address, copy, self.size)
            return _same_state(before, self.slow_save())
        finally:
            self.slow_restore(before)

    def save(self) -> Any:
        if self.fast is None:
            self.fast = self._check()
        if self.fast:
            address = self.address()
            if address is not None:
                return address, ctypes.string_at(address, self.size), self.extra()
        return self.slow_save()

    def restore(self, state: Any) -> None:
        if (
            self.fast
            and isinstance(state, tuple)
            and len(state) == 3
            and isinstance(state[1], bytes)
        ):
            address, copy, extra = state
            ctypes.memmove(address, copy, self.size)
            self.put_extra(extra)
            return
        self.slow_restore(state)

    def extra(self) -> Any:
        return None

    def put_extra(self, extra: Any) -> None:
        pass


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class _NumpyGenerator(_StateCopy):
    """numpy's global generator. np.random.get_state/set_state take ~120 us together (a
    624-word tuple each way); a copy of its 2,500-byte state through the bit generator's
    documented ctypes interface takes ~1 us. Not kept: the legacy normal sampler's cached
    second value."""

    size = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos

    def address(self) -> int | None:
        try:
            generator = np.random.get_bit_generator()  # type: ignore[attr-defined]
            if type(generator).__name__ != "MT19937":
                return None
            return int(generator.ctypes.state_address)
        except (AttributeError, TypeError):  # numpy < 1.25
            return None

    def slow_save(self) -> Any:
        return np.random.get_state()

    def slow_restore(self, state: Any) -> None:
        np.random.set_state(state)

    def draw(self) -> None:
        np.random.random(700)  # past a regeneration of the 624 words


class _PythonRandom(_StateCopy):
    """Python's `random`. getstate/setstate take ~20 us (625 ints built and read back); on
    CPython the generator object holds its index and 624 words right after the object header,
    which a copy takes in ~1 us (checked at first use, as every copy here). gauss_next, the
    Python-level part of the state, is kept beside."""

    size = 4 + 624 * 4  # int index; uint32_t state[624]

    def address(self) -> int | None:
        if sys.implementation.name != "cpython" or hasattr(sys, "_is_gil_enabled"):
            return None  # another layout (or a free-threaded build's larger header)
        return id(random._inst) + object.__basicsize__  # type: ignore[attr-defined]

    def slow_save(self) -> Any:
        return random.getstate()

    def slow_restore(self, state: Any) -> None:
        random.setstate(state)

    def draw(self) -> None:
        random.getrandbits(32 * 700)

    def extra(self) -> Any:
        return random._inst.gauss_next  # type: ignore[attr-defined]

    def put_extra(self, extra: Any) -> None:
        random._inst.gauss_next = extra  # type: ignore[attr-defined]


_NUMPY = _NumpyGenerator()
_PYTHON = _PythonRandom()


def _seed_worker(user_fn: Callable[[int], None] | None) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        # torch already gives each worker torch.initial_seed() = base + id, and the base comes
        # from the rank-mixed generator; carry it to random and numpy, which torch leaves alone.
        worker_seed = torch.initial_seed() % 2**32
        random.seed(worker_seed)
        _numpy_seed(worker_seed)
        if user_fn is not None:
            user_fn(worker_id)

    return init
