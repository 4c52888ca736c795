"""How many optimizer steps the job has completed, across restarts: the steps this process
did plus the count of the state it loaded. `s.save_state` and the rescue write it into the
state; `s.load_state` counts on from it. Under `ddpkit run` each rank keeps its count in a
mapped record of its state folder (protocol.StepCount), so the launcher can say what a failure
cost (the step it came at, the step the job went on from, the time between), even for a rank
that was killed.

A step ends at `optimizer.step()` (the rank's optimizer-step hub, ddpkit.rank.runtime,
subscribed to by `setup()`: one Python call and one 8-byte write a step); with several
optimizers the first one that steps marks the steps, as for everything else on the hub.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import runtime


@dataclass
class Count:
    """This rank's count, a part of its runtime."""

    base: int = 0  # the steps of the state this process loaded
    done: int = 0  # the steps this process did since
    subscription: Any = None  # on the rank's optimizer-step hub
    record: mmap.mmap | None = None

    def write(self, first_end: float, loaded: bool, rescued: bool) -> None:
        if self.record is not None:
            protocol.COUNT_FORMAT.pack_into(
                self.record, 0, self.base, self.done, first_end, loaded, rescued
            )


def _count() -> Count:
    return runtime.current().part(Count)


def install() -> None:
    count = _count()
    if count.subscription is not None:
        return
    count.subscription = runtime.current().steps.after(_stepped)
    count.record = _open_record()
    count.write(0.0, False, False)


def _open_record() -> mmap.mmap | None:
    here = runtime.current()
    if not here.is_rank():
        return None  # not a rank of ddpkit run (a DataLoader worker inherits the variables)
    try:
        path = here.path(protocol.COUNT)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, protocol.COUNT_FORMAT.size)
            return mmap.mmap(fd, protocol.COUNT_FORMAT.size)
        finally:
            os.close(fd)
    except OSError:
        return None


def _stepped(optimizer: Any) -> None:
    here = runtime.current()
    if not here.steps.counts(optimizer):
        return
    count = here.part(Count)
    count.done += 1
    if count.record is not None:
        if count.done == 1:
            struct.pack_into("<d", count.record, 16, time.time())
            from ddpkit.rank import progress

            progress.write_modules()  # what the next attempt's warm spares import
        count.record[8:16] = count.done.to_bytes(8, "little", signed=True)


def done() -> int:
    """The job's completed optimizer steps, as far as this process knows."""
    count = _count()
    return count.base + count.done


def resumed_at(steps: int, rescued: bool) -> None:
    """The state just loaded held `steps` completed steps (`rescued`: the one the ranks left
    wrote at a failure): count on from there."""
    count = _count()
    count.base, count.done = steps, 0
    count.write(0.0, True, rescued)
