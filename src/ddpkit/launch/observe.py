"""What a snapshot of the ranks says (`ddpkit.launch.base.snapshot`): who failed, who recorded an
error and hangs on tearing down, whether a failure's exits have landed, who never reached init
while others wait there. Plain functions of a snapshot (and `reap`, which asks the processes
how they exited); what it means for the job is `ddpkit.launch.base.decide`'s to say.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ddpkit.common import protocol
from ddpkit.common.ranges import ranks_text
from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.base.worker import Worker

log = logging.getLogger(__name__)


def waited(error: protocol.ErrorRecord | None) -> bool:
    """A rank's error that says it failed waiting for a peer."""
    return error is not None and any(word in error.message for word in protocol.WAITING_WORDS)


def reap(workers: list[Worker]) -> None:
    """Record the exit code and time of every worker that has exited since the last look."""
    for w in workers:
        if w.exit_code is None and (code := w.proc.poll()) is not None:
            w.exit_code, w.ended_wall = code, time.time()


def failed(snap: Snapshot) -> tuple[int, ...]:
    """Ranks that exited non-zero, or else those that recorded an error and hang on."""
    return tuple(v.rank for v in snap.failed_ranks)


def only_victims(snap: Snapshot) -> bool:
    """Every rank that failed so far failed waiting for a peer: the cause may be elsewhere."""
    ranks = set(failed(snap))
    return bool(ranks) and all(waited(v.error) for v in snap.ranks if v.rank in ranks)


def settled(snap: Snapshot) -> bool:
    """Whether a failure's near-simultaneous exits have landed. A live rank that has recorded
    its error is still landing (ranks that fail the same way at once are reported together).
    While every rank that failed so far failed waiting for a peer (its connection closed, a
    timeout ran out), a live rank still inside a collective is failing the same way, only
    slower on a loaded machine: it has not landed yet. A rank that failed for itself (a
    crash, an exception) settles at once otherwise."""
    if any(v.error is not None for v in snap.running):
        return False  # a rank that recorded its error is on its way out: let it land
    if not all(waited(v.error) for v in snap.failed_ranks):
        return True
    return not any(v.record is not None and v.record.in_collective for v in snap.running)


@dataclass(frozen=True)
class InitWait:
    """Ranks that waited in init_process_group past --init-timeout, and the ranks that never
    came (none: every rank came, and init never completed)."""

    waiting: list[int]
    missing: list[int]
    waited: float
    timeout: float

    @property
    def line(self) -> str:
        if not self.missing:
            return (
                f"init_process_group did not complete: rank{'s' if len(self.waiting) > 1 else ''} "
                f"{ranks_text(self.waiting)} waited {self.waited:.0f} s in it (--init-timeout "
                f"{self.timeout:g}): the ranks called it with a store, world size or address "
                "that does not match"
            )
        return (
            f"rank {ranks_text(self.missing)} never reached init_process_group; rank "
            f"{ranks_text(self.waiting)} waited {self.waited:.0f} s for it "
            f"(--init-timeout {self.timeout:g})"
        )


def missing_at_init(snap: Snapshot, timeout: float) -> InitWait | None:
    """Some ranks have waited in init_process_group for `timeout` s while others never got
    there, or every rank did and init never completed; None otherwise."""
    waiting = {v.rank: v.phase_since for v in snap.ranks if v.phase == "init"}
    if not waiting:
        return None
    missing = [v.rank for v in snap.ranks if v.absent]
    waited = snap.wall - min(waiting.values())
    if waited < timeout:
        return None
    if not missing and len(waiting) < len(snap.ranks):
        return None
    return InitWait(sorted(waiting), missing, waited, timeout)
