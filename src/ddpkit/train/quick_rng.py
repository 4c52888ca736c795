"""This process's random states, taken at every step's boundary for the rescue (issue 38) in a
few microseconds: the same dict as `ddpkit.train.state.rng_state()`, in which a stream that has
not moved since the last take is the last take's value rather than a new copy.

Why: Python's and numpy's global generators are Mersenne Twisters whose public getters build
their 624 words anew on every call (9 and 33 us here: most of the snapshot's cost, paid on every
step). Their raw words, read in place (2.5 KB, under a microsecond), say whether they moved; most
training steps draw from neither. The layout is checked once against the getters; where it does
not match (another interpreter, another numpy), the getters are called every time.

Exact: Python's state is its words plus `gauss_next`, both compared. numpy's legacy generator
also caches one Gaussian (`has_gauss`) that the words do not show; a draw that leaves the words
unchanged can only take that cached value, so a take whose `has_gauss` was set is never reused.
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, cast

import torch

_WORDS = 624
_RAW = 4 * _WORDS + 4  # the words and the position: 2,500 bytes in both generators


class _Python:
    """Python's `random` module state: its C struct after the object's header is
    `int index; uint32_t state[624]`; getstate() gives (3, (*state, index), gauss_next)."""

    def __init__(self) -> None:
        self.address = id(random._inst) + object.__basicsize__
        self.raw: bytes | None = None
        self.gauss: Any = None
        self.value: Any = None
        self.fast = self._layout_matches()

    def _layout_matches(self) -> bool:
        try:
            index, *words = struct.unpack(f"i{_WORDS}I", ctypes.string_at(self.address, _RAW))
            inner = random.getstate()[1]
            return tuple(words) == inner[:_WORDS] and index == inner[_WORDS]
        except Exception:  # an interpreter whose objects are laid out otherwise
            return False

    def take(self) -> Any:
        if not self.fast:
            self.value = random.getstate()
            return self.value
        raw, gauss = ctypes.string_at(self.address, _RAW), random._inst.gauss_next  # type: ignore[attr-defined]
        if raw != self.raw or gauss != self.gauss or self.value is None:
            self.raw, self.gauss, self.value = raw, gauss, random.getstate()
        return self.value

    def words(self) -> bytes:
        """The last take's words and position, as the struct holds them."""
        if self.fast and self.raw is not None:
            return self.raw
        inner = self.value[1]
        return struct.pack(f"i{_WORDS}I", inner[_WORDS], *inner[:_WORDS])


class _Numpy:
    """numpy's global legacy generator: MT19937's `uint32_t key[624]; int pos;` in place."""

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.raw: bytes | None = None
        self.value: Any = None
        self.fast = self._layout_matches()

    def _address(self) -> int:
        # np.random.seed keeps the generator object; set_state too: read it each time anyway
        return self.np.random.mtrand._rand._bit_generator.ctypes.state_address

    def _layout_matches(self) -> bool:
        try:
            raw = ctypes.string_at(self._address(), _RAW)
            _, keys, pos, _, _ = cast(Any, self.np.random.get_state())
            return raw[: 4 * _WORDS] == keys.astype("<u4").tobytes() and (
                struct.unpack("i", raw[4 * _WORDS :])[0] == pos
            )
        except Exception:  # another numpy: the getter each time
            return False

    def take(self) -> Any:
        if not self.fast:
            self.value = self.np.random.get_state()
            return self.value
        raw = ctypes.string_at(self._address(), _RAW)
        if raw != self.raw or self.value is None or self.value[3]:
            self.raw, self.value = raw, self.np.random.get_state()
        return self.value

    def words(self) -> bytes:
        """The last take's key and position, as the struct holds them."""
        if self.fast and self.raw is not None:
            return self.raw
        _, keys, pos, _, _ = cast(Any, self.value)
        return keys.astype("<u4").tobytes() + struct.pack("i", pos)


class QuickRng:
    """take(): the random states now, in rng_state()'s layout once `as_saved` converts them."""

    def __init__(self) -> None:
        self.torch_bytes: bytes | None = None
        self.torch_state: torch.Tensor | None = None
        self.cuda = torch.cuda.is_available()  # a microsecond a call: asked once
        self.python = _Python()
        try:
            self.numpy: _Numpy | None = _Numpy()
        except ImportError:
            self.numpy = None

    def take(self) -> dict[str, Any]:
        taken: dict[str, Any] = {"python": self.python.take(), "torch": self._torch()}
        if self.numpy is not None:
            taken["numpy"] = self.numpy.take()
        # A process that never touched CUDA has its generators as seeding left them; reading
        # them would start CUDA in a CPU rank (memory on the GPU, seconds)
        if self.cuda and torch.cuda.is_initialized():
            taken["cuda"] = [g.get_state() for g in torch.cuda.default_generators]
        return taken

    def _torch(self) -> torch.Tensor:
        """torch's CPU generator: the last take's tensor when its bytes did not move (a
        comparison of bytes is a quarter of torch.equal's cost on its 5 KB)."""
        state = torch.get_rng_state()
        raw = state.numpy().tobytes()
        if raw != self.torch_bytes or self.torch_state is None:
            self.torch_bytes, self.torch_state = raw, state
        return self.torch_state


def as_saved(taken: dict[str, Any]) -> dict[str, Any]:
    """A take in the layout `state.set_rng_state` reads (numpy's words as a tensor)."""
    saved = dict(taken)
    if "numpy" in saved:
        kind, keys, pos, has_gauss, gauss = saved["numpy"]
        saved["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return saved
