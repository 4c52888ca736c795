"""How many optimizer steps the job has completed, across restarts: the steps this process
did plus the count of the state it loaded. `s.save_state` and the rescue write it into the
state; `s.load_state` counts on from it. Under `ddpkit run` each rank keeps its count in a
mapped record of its state folder (protocol.StepCount), so the launcher can say what a failure
cost (the step it came at, the step the job went on from, the time between), even for a rank
that was killed.

A step ends at `optimizer.step()` (torch's global optimizer hook, installed by `setup()`: one
Python call and one 8-byte write a step); with several optimizers the first one that steps
marks the steps, as the step timing does (ddpkit.rank.steps).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Any

from ddpkit.common import protocol

_base = 0  # the steps of the state this process loaded
_done = 0  # the steps this process did since
_marker: int | None = None  # id() of the optimizer whose steps count
_hook: Any = None
_record: mmap.mmap | None = None


def install() -> None:
    global _hook, _record
    if _hook is not None:
        return
    import torch.optim.optimizer as optimizer_module

    _hook = optimizer_module.register_optimizer_step_post_hook(_stepped)
    _record = _open_record()
    _write(0.0, False, False)


def _open_record() -> mmap.mmap | None:
    state_dir, rank = os.environ.get(protocol.STATE_DIR), os.environ.get("RANK")
    if not state_dir or rank is None or os.environ.get(protocol.RANK_PID) != str(os.getpid()):
        return None  # not a rank of ddpkit run (a DataLoader worker inherits the variables)
    try:
        path = protocol.state_path(state_dir, rank, protocol.COUNT)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, protocol.COUNT_FORMAT.size)
            return mmap.mmap(fd, protocol.COUNT_FORMAT.size)
        finally:
            os.close(fd)
    except OSError:
        return None


def _write(first_end: float, loaded: bool, rescued: bool) -> None:
    if _record is not None:
        protocol.COUNT_FORMAT.pack_into(_record, 0, _base, _done, first_end, loaded, rescued)


def _stepped(optimizer: Any, *_: Any) -> None:
    global _done, _marker
    if _marker is None:
        _marker = id(optimizer)
    if id(optimizer) != _marker:
        return
    _done += 1
    if _record is not None:
        if _done == 1:
            struct.pack_into("<d", _record, 16, time.time())
            from ddpkit.rank import progress

            progress.write_modules()  # what the next attempt's warm spares import
        _record[8:16] = _done.to_bytes(8, "little", signed=True)


def done() -> int:
    """The job's completed optimizer steps, as far as this process knows."""
    return _base + _done


def resumed_at(steps: int, rescued: bool) -> None:
    """The state just loaded held `steps` completed steps (`rescued`: the one the ranks left
    wrote at a failure): count on from there."""
    global _base, _done
    _base, _done = steps, 0
    _write(0.0, True, rescued)
