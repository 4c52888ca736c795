"""Each rank's random states at the last step's boundary, in a file its node's other ranks can
read after it died (issue 38): the rescue writes the failed rank's part from it, so the resumed
job draws exactly the numbers the never-failed job drew.

Why a file: a rank that fails does not write its part (its streams have moved since the
boundary, or it was killed), and its streams exist nowhere else. The file lives in the run's
node-local state folder (`rank{R}.rng`), memory-mapped once: each boundary is a copy of ~10 KB
into it (a few microseconds; the page cache keeps it when the process is killed). Two slots
alternate, each framed by its boundary's number at both ends, so a rank killed in the middle of
a copy leaves the previous boundary whole. A rank on another node is out of reach: its part is
re-seeded at load, as before.

A rank can die between its optimizer step and its next fetch, after the others passed the
boundary: its streams are written at the optimizer step too, labelled with the coming boundary;
at the fetch they are written again if they moved in between, else that copy is marked as the
fetch's (one byte). The loop is the same on every rank, so a
survivor whose own streams did not move there may take the failed rank's copy from its
optimizer step; one whose streams moved takes only a copy from the fetch itself.

Outside a worker of `ddpkit run` (no state folder) nothing is written.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import runtime
from ddpkit.train.quick_rng import streams_of

SLOT = 16384  # bytes per slot: the streams take ~10.6 KB (CUDA: 16 bytes a GPU)
_FRAME = struct.Struct("<qqq?7x")  # boundary number, base, payload length, taken at the fetch
_FETCHED = 24  # the flag's offset in the frame
_END = struct.Struct("<q")


def path_of(state_dir: str | Path, rank: int) -> Path:
    return protocol.state_path(state_dir, rank, protocol.RNG)


class RngFile:
    """This rank's file, mapped; `write` puts one boundary's streams in the next slot."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # allocated now: a page first touched through the map on a full disk is SIGBUS
            os.posix_fallocate(fd, 0, 2 * SLOT)
            self.map = mmap.mmap(fd, 2 * SLOT)
        finally:
            os.close(fd)

    def put(self, base: int, boundary: int, payload: bytes, fetched: bool = True) -> None:
        """One boundary's streams (quick_rng's payload) into its slot; `fetched`: read at the
        boundary itself, not at the optimizer step that ended the step before. The slot's frame
        says no boundary until the copy is whole: a rank killed in the middle of rewriting a
        slot leaves it unread, never half old and half new."""
        at = (boundary % 2) * SLOT
        end = at + _FRAME.size + len(payload)
        if end + _END.size > at + SLOT:
            return  # more GPUs than a slot holds: the rank's part is re-seeded, as before
        _FRAME.pack_into(self.map, at, -1, base, len(payload), fetched)
        self.map[at + _FRAME.size : end] = payload
        _END.pack_into(self.map, end, boundary)
        _FRAME.pack_into(self.map, at, boundary, base, len(payload), fetched)

    def mark_fetched(self, boundary: int) -> None:
        """The copy in `boundary`'s slot, made at the optimizer step, is the boundary's too (no
        stream moved in between)."""
        self.map[(boundary % 2) * SLOT + _FETCHED] = 1


def read(path: Path, base: int, boundary: int, fetched: bool = False) -> dict[str, Any] | None:
    """The streams this file holds for (base, boundary), in `state.rng_state()`'s layout; None
    when it holds no whole copy of that boundary (`fetched`: none taken at the boundary
    itself; a copy from the optimizer step before it will not do)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    at = (boundary % 2) * SLOT
    if len(raw) < at + SLOT:
        return None
    number, its_base, length, at_fetch = _FRAME.unpack_from(raw, at)
    end = at + _FRAME.size + length
    if (number, its_base) != (boundary, base) or end + _END.size > at + SLOT:
        return None
    if fetched and not at_fetch:
        return None
    if _END.unpack_from(raw, end)[0] != boundary:
        return None  # the copy was cut off
    return streams_of(raw[at + _FRAME.size : end])


def mine() -> RngFile | None:
    """This rank's file when it is a rank of `ddpkit run` (else None)."""
    here = runtime.current()
    if not here.is_rank():
        return None
    try:
        return RngFile(path_of(here.state_dir, int(here.rank_name)))
    except (OSError, ValueError):
        return None


def of_rank(rank: int) -> Path | None:
    """Where another rank of this node keeps its file, if this process is a rank of a run."""
    state_dir = runtime.current().state_dir
    return path_of(state_dir, rank) if state_dir else None
