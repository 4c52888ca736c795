"""This process's random streams as one string of bytes, read at every step's boundary for the
rescue (issue 38) in a few microseconds, and read back into `ddpkit.train.state.rng_state()`'s
layout (`streams_of`) only when a rescue writes them.

Why bytes: the rescue needs the streams at two moments of every step (the optimizer step's end,
for a rank that dies before its next batch; the next batch, the boundary itself), copies them
into the rank's file (ddpkit.train.rng_file) and asks whether they moved in between. Bytes do
all three at once: one string written into the file in one copy, and compared in one call.
Each Python call here is paid 3-6 times over after a training step (the caches are cold), so
the reading is a handful of calls: Python's and numpy's Mersenne Twisters are read in place
(their getters build their 624 words anew on every call: 9 and 33 us warm); torch's CPU state
and each CUDA generator's through their getters.

The layout of Python's and numpy's generators is checked once against their getters; where it
does not match (another interpreter, another numpy) the getters are called every time.

Exact: Python's state is its words plus `gauss_next`, both read. numpy's legacy generator also
caches one Gaussian (`has_gauss`) that its words do not show; its getter is called whenever the
words moved or a Gaussian was cached at the last call, so a cached value is never missed.
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, cast

import torch

_WORDS = 624
_RAW = 4 * _WORDS + 4  # the words and the position: 2,500 bytes in both generators
_GAUSS = struct.Struct("<Bd")  # has a cached Gaussian, its value
_LENGTH = struct.Struct("<i")
_NO_GAUSS = _GAUSS.pack(0, 0.0)


class _Python:
    """Python's `random` module state: its C struct after the object's header is
    `int index; uint32_t state[624]`; getstate() gives (3, (*state, index), gauss_next)."""

    def __init__(self) -> None:
        self.address = id(random._inst) + object.__basicsize__
        self.fast = self._layout_matches()

    def _layout_matches(self) -> bool:
        try:
            return ctypes.string_at(self.address, _RAW) == self._from_getter()
        except Exception:  # an interpreter whose objects are laid out otherwise
            return False

    @staticmethod
    def _from_getter() -> bytes:
        inner = random.getstate()[1]
        return struct.pack(f"i{_WORDS}I", inner[_WORDS], *inner[:_WORDS])

    def words(self) -> bytes:
        return ctypes.string_at(self.address, _RAW) if self.fast else self._from_getter()


class _Numpy:
    """numpy's global legacy generator: MT19937's `uint32_t key[624]; int pos;` in place."""

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.generator: Any = None  # np.random.seed and set_state keep it; checked each time
        self.address = 0
        self.words: bytes | None = None  # the words at the getter's last call ...
        self.gauss = b""  # ... and its cached Gaussian, packed; "" when one was cached
        self.fast = self._layout_matches()

    def _located(self) -> int:
        generator = self.np.random.mtrand._rand._bit_generator
        if generator is not self.generator:
            self.generator, self.address = generator, generator.ctypes.state_address
        return self.address

    def _layout_matches(self) -> bool:
        try:
            return ctypes.string_at(self._located(), _RAW) == self._from_getter()[0]
        except Exception:  # another numpy: the getter each time
            return False

    def _from_getter(self) -> tuple[bytes, bytes]:
        _, keys, pos, has_gauss, gauss = cast(Any, self.np.random.get_state())
        return keys.astype("<u4").tobytes() + struct.pack("i", pos), _GAUSS.pack(has_gauss, gauss)

    def part(self) -> tuple[bytes, bytes]:
        """(words, packed Gaussian) now."""
        if not self.fast:
            return self._from_getter()
        words = ctypes.string_at(self._located(), _RAW)
        if words != self.words or not self.gauss:
            self.words = words
            gauss = self._from_getter()[1]
            self.gauss = gauss if gauss == _NO_GAUSS else b""
            return words, gauss
        return words, self.gauss


class LiveStreams:
    """payload(): the random streams now, as bytes (`streams_of` reads them back)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()  # a microsecond a call: asked once
        self.python = _Python()
        try:
            self.numpy: _Numpy | None = _Numpy()
        except ImportError:
            self.numpy = None

    def payload(self) -> bytes:
        rnd = cast(Any, random._inst)
        gauss = rnd.gauss_next
        parts = [self.python.words(), _GAUSS.pack(gauss is not None, gauss or 0.0)]
        if self.numpy is not None:
            parts += [b"\x01", *self.numpy.part()]
        else:
            parts.append(b"\x00")
        state = torch.get_rng_state()
        parts += [_LENGTH.pack(state.numel()), ctypes.string_at(state.data_ptr(), state.numel())]
        # A process that never touched CUDA has its generators as seeding left them; reading
        # them would start CUDA in a CPU rank (memory on the GPU, seconds)
        if self.cuda and torch.cuda.is_initialized():
            for generator in torch.cuda.default_generators:
                cuda = generator.get_state()
                parts += [_LENGTH.pack(cuda.numel()), cuda.numpy().tobytes()]
        return b"".join(parts)


def streams_of(payload: bytes) -> dict[str, Any]:
    """A payload in `state.rng_state()`'s layout (what `state.set_rng_state` reads)."""
    import numpy as np

    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        at += n
        return payload[at - n : at]

    index, *words = struct.unpack(f"<i{_WORDS}I", take(_RAW))
    has, gauss = _GAUSS.unpack(take(_GAUSS.size))
    streams: dict[str, Any] = {"python": (3, (*words, index), gauss if has else None)}
    if take(1) == b"\x01":
        keys = np.frombuffer(take(4 * _WORDS), dtype="<u4").astype("int64")
        (pos,) = struct.unpack("<i", take(4))
        has, gauss = _GAUSS.unpack(take(_GAUSS.size))
        streams["numpy"] = ("MT19937", torch.from_numpy(keys), pos, int(has), gauss)
    tensors = []
    while at < len(payload):
        (n,) = _LENGTH.unpack(take(_LENGTH.size))
        tensors.append(torch.frombuffer(bytearray(take(n)), dtype=torch.uint8))
    streams["torch"] = tensors[0]
    if len(tensors) > 1:
        streams["cuda"] = tensors[1:]
    return streams
