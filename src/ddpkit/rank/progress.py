"""What this rank tells the launcher, the one way the library and the bootstrap do it: its
progress record (the format is `ddpkit.common.protocol.Record`: written by the bootstrap's
collective wrappers, beaten by ddpkit's helpers and its tick thread, read by the launcher's hang
watch), its phase (started, init, ready) and whether it reads s.stop_requested (graceful).
Outside a worker of `ddpkit run` every call here does nothing."""

from __future__ import annotations

import os
import threading
import time

from ddpkit.common import protocol

_writer: protocol.RecordWriter | None = None
_opened = False


def writer() -> protocol.RecordWriter | None:
    """This process's writer when it is a rank started by ddpkit run (else None)."""
    global _writer, _opened
    if not _opened:
        _opened = True
        state_dir, rank = os.environ.get(protocol.STATE_DIR), os.environ.get("RANK")
        # only the rank itself: a DataLoader worker inherits the variables but is not the rank
        if state_dir and rank is not None and os.environ.get(protocol.RANK_PID) == str(os.getpid()):
            try:
                _writer = protocol.RecordWriter(
                    protocol.state_path(state_dir, rank, protocol.PROGRESS)
                )
            except OSError:
                _writer = None
    return _writer


def beat() -> None:
    """Tell the launcher this rank is making progress (called by ddpkit's helpers)."""
    w = writer()
    if w is not None:
        w.beat()


def start_ticking() -> None:
    """A thread that ticks the record every protocol.TICK_EVERY s while Python threads can run:
    the launcher tells a rank stuck in C code holding the GIL from one that computes."""
    w = writer()
    if w is None:
        return

    def tick() -> None:
        while True:
            w.tick()
            time.sleep(protocol.TICK_EVERY)

    threading.Thread(target=tick, daemon=True, name="ddpkit-tick").start()


def _state_dir() -> tuple[str, str] | None:
    state_dir, rank = os.environ.get(protocol.STATE_DIR), os.environ.get("RANK", "0")
    return (state_dir, rank) if state_dir else None


def set_phase(phase: str) -> None:
    """Where this rank is in start-up: started, init (waiting for its peers), ready."""
    where = _state_dir()
    if where is not None:
        try:
            protocol.write_phase(where[0], where[1], phase)
        except OSError:
            pass


def mark_graceful() -> None:
    """This rank reads s.stop_requested: after forwarding a stop signal the launcher gives it
    time to save before it kills."""
    where = _state_dir()
    if where is not None:
        try:
            protocol.state_path(where[0], where[1], protocol.GRACEFUL).touch()
        except OSError:
            pass
