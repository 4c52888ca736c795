"""Each rank's progress record: a few hundred bytes in a memory-mapped file per rank.

The rank writes (from the bootstrap's collective wrappers and ddpkit's helpers): how many
collectives it has finished, whether it is inside one now (which, since when, called from
which file:line, with which shapes), and a beat counter that ddpkit's loader and helpers bump.
The launcher reads the records to tell progress from a hang without any help from the script.
Writes cost a struct pack into shared memory (about a microsecond); reads may see a record
mid-update, which only delays a verdict by one sample.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

_FORMAT = struct.Struct("<QQdB7x32s96s160s")
SIZE = _FORMAT.size


@dataclass(frozen=True)
class Record:
    finished: int = 0  # collectives completed
    beats: int = 0  # ddpkit helper activity (loader batches, reduce, ...)
    since: float = 0.0  # wall time the current collective started
    in_collective: bool = False
    op: str = ""
    shapes: str = ""
    site: str = ""  # file:line (function) of the user's call


def path_for(state_dir: str | Path, rank: int | str) -> Path:
    return Path(state_dir) / f"rank{rank}.progress"


class Writer:
    """The rank's side."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, SIZE)
        self._map = mmap.mmap(fd, SIZE)
        os.close(fd)
        self.finished = 0
        self.beats = 0
        self._write(False, "", "", "", 0.0)

    def _write(self, inside: bool, op: str, shapes: str, site: str, since: float) -> None:
        self._map[:SIZE] = _FORMAT.pack(
            self.finished,
            self.beats,
            since,
            inside,
            op.encode()[:32],
            shapes.encode()[:96],
            site.encode()[:160],
        )

    def enter(self, op: str, shapes: str, site: str) -> None:
        self._write(True, op, shapes, site, time.time())

    def leave(self, op: str, shapes: str, site: str) -> None:
        self.finished += 1
        self._write(False, op, shapes, site, 0.0)

    def beat(self) -> None:
        self.beats += 1
        struct.pack_into("<Q", self._map, 8, self.beats)


def read(path: Path) -> Record | None:
    """The launcher's side: the record, or None before the rank created it."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < SIZE:
        return None
    finished, beats, since, inside, op, shapes, site = _FORMAT.unpack(raw[:SIZE])
    return Record(finished, beats, since, bool(inside), _text(op), _text(shapes), _text(site))


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


_writer: Writer | None = None
_opened = False


def writer() -> Writer | None:
    """This process's writer when it is a rank started by ddpkit run (else None)."""
    global _writer, _opened
    if not _opened:
        _opened = True
        state_dir, rank = os.environ.get("DDPKIT_STATE_DIR"), os.environ.get("RANK")
        # only the rank itself: a DataLoader worker inherits the variables but is not the rank
        if state_dir and rank is not None and os.environ.get("DDPKIT_RANK_PID") == str(os.getpid()):
            try:
                _writer = Writer(path_for(state_dir, rank))
            except OSError:
                _writer = None
    return _writer


def beat() -> None:
    """Tell the launcher this rank is making progress (called by ddpkit's helpers)."""
    w = writer()
    if w is not None:
        w.beat()
