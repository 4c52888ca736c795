"""The supervisor's look at its ranks, from their processes and the state files they write
(`ddpkit.common.protocol`): who exited with what, who recorded an error and hangs on tearing
down, who never reached init while others wait there. Each function reads and returns plain
data; what it means is `ddpkit.launch.decide`'s to say.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ddpkit.common import protocol
from ddpkit.common.ranges import ranks_text
from ddpkit.launch.hang.blame import waited

ERROR_EXIT_WAIT = 3.0  # seconds a rank that recorded an error may take to exit


def reap(workers: list[Any]) -> None:
    """Record the exit code and time of every worker that has exited since the last look."""
    for w in workers:
        if w.exit_code is None and (code := w.proc.poll()) is not None:
            w.exit_code, w.ended_wall = code, time.time()


def errored(workers: list[Any], state_dir: Path) -> list[Any]:
    """Ranks that recorded an uncaught error but have not exited ERROR_EXIT_WAIT s later (e.g.
    stuck tearing down NCCL while a peer waits in a collective): failed all the same, with the
    code they meant to exit with."""
    stuck = []
    for w in workers:
        if w.exit_code is not None:
            continue
        error = protocol.state_path(state_dir, w.rank, protocol.ERROR)
        try:
            written = error.stat().st_mtime
        except OSError:
            continue
        if time.time() - written > ERROR_EXIT_WAIT:
            record = protocol.read_error(state_dir, w.rank)
            code = record.exit_code if record and record.exit_code is not None else 1
            w.exit_code, w.ended_wall = code, written
            stuck.append(w)
    return stuck


def failed(workers: list[Any], state_dir: Path) -> list[Any]:
    """Ranks that exited non-zero, or else those that recorded an error and hang on."""
    return [w for w in workers if w.exit_code not in (None, 0)] or errored(workers, state_dir)


def settled(workers: list[Any], state_dir: Path) -> bool:
    """Whether a failure's near-simultaneous exits have landed. A live rank that has recorded
    its error is still landing (ranks that fail the same way at once are reported together).
    While every rank that failed so far failed waiting for a peer (its connection closed, a
    timeout ran out), a live rank still inside a collective is failing the same way, only
    slower on a loaded machine: it has not landed yet. A rank that failed for itself (a
    crash, an exception) settles at once otherwise."""
    failed = [w for w in workers if w.exit_code not in (None, 0)]
    if any(w.exit_code is None and protocol.read_error(state_dir, w.rank) for w in workers):
        return False  # a rank that recorded its error is on its way out: let it land
    if not all(waited(protocol.read_error(state_dir, w.rank)) for w in failed):
        return True
    for w in workers:
        if w.exit_code is None:
            record = protocol.read_record(state_dir, w.rank)
            if record is not None and record.in_collective:
                return False
    return True


def absent(w: Any, state_dir: Path, phase: str | None = None) -> bool:
    """A live rank that has not reached init_process_group."""
    phase = phase or protocol.read_phase(state_dir, w.rank)[0]
    return phase in ("starting", "started") and w.exit_code is None


def missing_at_init(workers: list[Any], state_dir: Path, timeout: float) -> str | None:
    """A verdict when some ranks have waited in init_process_group for `timeout` s while
    others never got there."""
    phases = {w.rank: protocol.read_phase(state_dir, w.rank) for w in workers}
    waiting = {r: t for r, (p, t) in phases.items() if p == "init"}
    if not waiting:
        return None
    missing = [w.rank for w in workers if absent(w, state_dir, phases[w.rank][0])]
    waited = time.time() - min(waiting.values())
    if waited < timeout:
        return None
    if not missing and len(waiting) == len(workers):  # all came, and init never completed
        return (
            f"init_process_group did not complete: rank{'s' if len(waiting) > 1 else ''} "
            f"{ranks_text(sorted(waiting))} waited {waited:.0f} s in it (--init-timeout "
            f"{timeout:g}): the ranks called it with a store, world size or address that does "
            "not match"
        )
    if not missing:
        return None
    return (
        f"rank {ranks_text(missing)} never reached init_process_group; rank "
        f"{ranks_text(sorted(waiting))} waited {waited:.0f} s for it "
        f"(--init-timeout {timeout:g})"
    )
