"""Workers without processes, and the snapshot the supervisor would take of them: the decision
tables give ranks their exit codes and write real state files (ddpkit.common.protocol's
formats); `look` reads those files as the supervisor does, through ddpkit.launch.base.snapshot."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ddpkit.launch.base.snapshot import Reader, Snapshot
from ddpkit.launch.base.worker import Worker


def worker(rank: int, exit_code: int | None = None, ended: float = 0.0) -> Worker:
    """A rank that exited with `exit_code` at `ended` (None: it runs); pid 0, no output."""
    proc = SimpleNamespace(pid=0, poll=lambda: exit_code)
    return Worker(rank=rank, proc=proc, output=None, exit_code=exit_code, ended_wall=ended)  # type: ignore[arg-type]


def look(state: Path, workers: list[Worker]) -> Snapshot:
    """The snapshot the supervisor would take of these workers and these files."""
    return Reader(state).look(workers, steps=True)


def diagnosed(snap: Snapshot, oom=None, growth=None, places_of=None):
    """The cause of a failed attempt, as the launcher's diagnosis names it."""
    from ddpkit.launch import diagnosis

    return diagnosis.failed(diagnosis.Failure(snap, oom, growth, places_of))


def failed_outcome(snap: Snapshot, oom=None, growth=None):
    """The outcome the launcher reports for a failed attempt."""
    from ddpkit.launch.report import Outcome

    return Outcome.of(diagnosed(snap, oom, growth))


def waited_for(snap: Snapshot, places_of):
    """The rank the failed ranks waited for, when every failed rank only waited (else None)."""
    from ddpkit.launch import diagnosis

    cause = diagnosed(snap, places_of=places_of)
    return cause if cause.kind in diagnosis.WAITED_FOR else None
