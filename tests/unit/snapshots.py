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
