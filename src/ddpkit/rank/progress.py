"""This rank's progress record (the format is `ddpkit.common.protocol.Record`): written by the
bootstrap's collective wrappers and beaten by ddpkit's helpers, read by the launcher's hang
watch. Outside a worker of `ddpkit run` every call here does nothing."""

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
