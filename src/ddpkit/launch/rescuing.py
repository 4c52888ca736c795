"""Before a failed attempt's ranks are stopped, the ranks left write the last completed step.

A rank that fails waiting for a peer writes it from its error hook (ddpkit.train.rescue). But a
rank may never hear that its peer is gone: under NCCL its collective with the lost peer never
returns, and under gloo a dead rank's DataLoader workers (forked, holding its connections) keep
its peers waiting until they notice, seconds later. So before the teardown the launcher asks
every live rank that keeps a step it could write (`rankN.rescue-ready`: the snapshot's
`rescuable`) and has recorded no error (one that failed waiting for its peer writes from its
error hook); each answers from a thread of its own once its part is written. A rank whose
thread never takes the request (C code holding the GIL) is not waited for. The ranks that
answered have nothing left to save: they are ended at once, not given the stop's grace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.launch.base import asking
from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.base.worker import Worker

RESCUE = asking.Question(protocol.RESCUE_DONE, protocol.RESCUE_REQUEST)
TAKEN_WITHIN = 2.0  # seconds for a rank's answering thread to take the request (it polls 0.2 s)
WRITTEN_WITHIN = 120.0  # seconds for the parts to be written once taken (a large model's)

log = logging.getLogger(__name__)


def ask_survivors(
    workers: list[Worker], snap: Snapshot, state_dir: Path, wait: Wait
) -> dict[int, str]:
    """Ask the live ranks that can write to write, and wait for their answers (or their ends);
    rank -> what it did. The ranks that answered are ended (SIGKILL to their process group)."""
    asked = {
        v.rank: v.pid
        for v in snap.running
        if v.error is None  # one that recorded an error writes from its error hook, and ends
        and v.rescuable
    }
    if not asked:
        return {}
    log.debug("asking ranks %s to write the last completed step", sorted(asked))
    by_rank = {w.rank: w for w in workers}
    asking.ask(RESCUE, state_dir, asked)
    began = time.monotonic()
    answers: dict[int, str] = {}

    def finished() -> bool:
        pending = False
        for rank in asked:
            if rank in answers or by_rank[rank].proc.poll() is not None:
                continue
            data = asking.answer(RESCUE, state_dir, rank)
            if data is not None:
                answers[rank] = data.decode(errors="replace")
                continue
            request = RESCUE.paths(state_dir, rank)[0]
            if request is not None and request.exists() and time.monotonic() - began > TAKEN_WITHIN:
                continue  # its thread cannot run: not waited for
            pending = True
        return not pending

    wait.until(finished, WRITTEN_WITHIN)
    for rank in answers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(by_rank[rank].pgid, signal.SIGKILL)
    log.debug("rescue answers: %s", answers)
    return answers
