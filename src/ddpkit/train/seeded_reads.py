"""Randomness inside `Dataset.__getitem__`, the same whoever reads a batch: each batch of
(epoch, index) keys is read with every random generator (torch's CPU one, Python's, numpy's)
seeded from (seed, epoch, the batch's first index, its size), so batch b of epoch e is the same
whichever DataLoader worker reads it, whatever `num_workers` is, resumed or not. In the main
process the generators' states around the read are saved and put back, so the training loop's
own randomness is not disturbed; they are copied as bytes where a check at first use shows the
copy round-trips (~1 us instead of ~120 us for numpy's get/set_state). Seeding per batch, not
per sample, keeps the loader within 1.5x of torch's DataLoader on an in-memory dataset
(benchmarks/results/cpu-loader_cost.txt); the time it takes is counted as the host's, never as
the user's data time."""

from __future__ import annotations

import ctypes
import random
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.rank import steps
from ddpkit.train.seeding import mix


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
        return self._read(mix(self.seed, epoch, index), [index], single=True)

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """A whole batch (torch's fetcher asks for batches this way): one seeding per batch,
        which is what keeps the loader's cost near torch's own."""
        epoch, first = keys[0]
        return self._read(mix(self.seed, epoch, first, len(keys)), [i for _, i in keys])

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


def _seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # the CPU generator (torch.manual_seed: 100x)
    random.seed(seed)
    _numpy_seed(seed)


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
