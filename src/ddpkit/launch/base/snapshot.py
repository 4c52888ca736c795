"""One view of the ranks per poll: what each rank's files and process say, read once.

`Reader.look(workers)` reads every rank's phase, progress record, step count, error, process
group, end and (once a rank failed) its memory facts, plus the steps written since the last
read, and returns a frozen `Snapshot`. The watches, the decisions, the diagnosis, the report
and the restart's cost line take that snapshot; none of them reads a rank's file itself
(`ddpkit.common.protocol` is read here). A recording's breakdown reads a rank's whole step
ring once, through `Reader.timed_steps`.

The phase, the progress record and the step count (what changes while a rank runs) are read at
every look; the files a rank writes once or twice (its error, group, end, and its memory facts
at an out-of-memory error) only when their modification time or size moved; the step rings (40
KiB each) and the process trees every STEPS_EVERY/USAGE_EVERY s. benchmarks/snapshot_cost.py
measures what that costs.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar, cast

import psutil

from ddpkit.common import procs, protocol
from ddpkit.launch.base.worker import Worker

STEPS_EVERY = 1.0  # seconds between reads of the step rings
USAGE_EVERY = 1.0  # seconds between samples of the ranks' process trees (CPU, I/O, memory)
T = TypeVar("T")


@dataclass(frozen=True)
class RankView:
    """One rank as the launcher saw it in one look."""

    rank: int
    pid: int
    exit_code: int | None = None  # None: it runs
    ended_wall: float = 0.0  # wall time it exited (its error's time for a stuck rank)
    stopped: bool = False  # ended by the launcher's teardown
    rss: int = 0  # bytes its process tree held at the last sample
    profiling: bool = False  # its profiler recorded at the last sample (its memory grows)
    cpu: float = -1.0  # CPU seconds its process tree used so far (-1: not sampled this look)
    io: int = -1  # bytes its process tree read and wrote so far (-1: not sampled this look)
    phase: str = "starting"  # starting, started, init, ready, ... (protocol.write_phase)
    phase_since: float = 0.0  # wall time the phase began
    record: protocol.Record | None = None  # its progress record
    error: protocol.ErrorRecord | None = None  # its uncaught error, once it wrote one
    error_written: float = 0.0  # wall time the error file was written
    group: tuple[str, float] | None = None  # its process group's (backend, timeout)
    ended: tuple[int, float] | None = None  # (code, wall time) it said as it ended
    memory: protocol.OomFacts | None = None  # its OOM facts (rank/oom_facts.py), once written
    memory_snapshot: bool = False  # it wrote its allocator's history (--memory-snapshot)
    fault: str = ""  # faulthandler's dump at the fatal signal it died of
    graceful: bool = False  # it reads s.stop_requested: it saves before it leaves a stop
    answers: bool = False  # it answers flight-recorder questions (its group exists)
    rescuable: bool = False  # it keeps a completed step it could write (ddpkit.train.rescue)
    steps: protocol.StepRecord | None = None  # steps written since the last read
    count: protocol.StepCount | None = None  # the job's steps as it counts them, at this look
    # the code a rank that hung on after its error meant to exit with (in `failed_ranks`)
    meant: int | None = None

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @property
    def failed(self) -> bool:
        return self.exit_code not in (None, 0) or self.meant is not None

    @property
    def code(self) -> int | None:
        """The code it exited with, or the one it means to exit with."""
        return self.exit_code if self.exit_code is not None else self.meant

    @property
    def absent(self) -> bool:
        """A live rank that has not reached init_process_group."""
        return self.alive and self.phase in ("starting", "started")


ERROR_EXIT_WAIT = 3.0  # seconds a rank that recorded an error may take to exit


def _meant(error: protocol.ErrorRecord | None) -> int:
    return error.exit_code if error is not None and error.exit_code is not None else 1


@dataclass(frozen=True)
class Snapshot:
    """Every rank of this node, as seen at `wall` (time.time()) and `mono` (monotonic)."""

    ranks: tuple[RankView, ...]
    wall: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)
    state_dir: Path = Path(".")  # where the ranks' files are (for paths in reports)
    sampled: bool = False  # the process trees were sampled in this look (cpu, io, rss)
    stepped: bool = False  # the step rings were read in this look (each view's `steps`)

    def of(self, rank: int) -> RankView:
        return next(v for v in self.ranks if v.rank == rank)

    def only(self, ranks: Iterable[int]) -> tuple[RankView, ...]:
        chosen = set(ranks)
        return tuple(v for v in self.ranks if v.rank in chosen)

    def narrowed(self, ranks: Iterable[int]) -> Snapshot:
        """The same look, at these ranks only."""
        return replace(self, ranks=self.only(ranks))

    @property
    def running(self) -> tuple[RankView, ...]:
        return tuple(v for v in self.ranks if v.alive)

    @property
    def failed_ranks(self) -> tuple[RankView, ...]:
        """Ranks that exited non-zero; while none has, those that hung on after recording
        their error (stuck tearing down NCCL while a peer waits), each with the code it chose
        (its error's, else 1) and the time it said so; their exit codes stay unknown."""
        exited = tuple(v for v in self.ranks if v.exit_code not in (None, 0))
        return exited or tuple(
            replace(v, meant=_meant(v.error), ended_wall=v.error_written)
            for v in self.ranks
            if self.hung_on(v) and v.error is not None
        )

    def hung_on(self, view: RankView) -> bool:
        """A live rank that recorded its error ERROR_EXIT_WAIT s ago and has not exited."""
        return (
            view.exit_code is None
            and view.error is not None
            and self.wall - view.error_written > ERROR_EXIT_WAIT
        )

    def group(self) -> tuple[str, float] | None:
        """The process group's (backend, timeout), from the first rank that wrote it."""
        return next((v.group for v in self.ranks if v.group is not None), None)


class Reader:
    """Reads a state folder's rank files; keeps what it needs to read only what changed."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._kept: dict[tuple[int, str], tuple[tuple[int, int], object]] = {}
        self._steps_read: dict[int, int] = {}
        self._next_steps = self._next_usage = 0.0
        self._rss: dict[int, int] = {}
        self._profiling: dict[int, bool] = {}
        self._paths: dict[tuple[int, str], str] = {}

    def look(
        self, workers: list[Worker], steps: bool | None = None, usage: bool | None = None
    ) -> Snapshot:
        """A snapshot of `workers` (their exit codes as the supervisor reaped them); the step
        rings are read and the process trees sampled when `steps`/`usage` say so, or else every
        STEPS_EVERY/USAGE_EVERY s."""
        mono = time.monotonic()
        if steps is None:
            steps = mono >= self._next_steps
        if steps:
            self._next_steps = mono + STEPS_EVERY
        if usage is None:
            usage = mono >= self._next_usage
        if usage:
            self._next_usage = mono + USAGE_EVERY
        views = tuple(
            self._view(w.rank, w.proc.pid, w.exit_code, w.ended_wall, w.stopped, steps, usage)
            for w in workers
        )
        return Snapshot(views, time.time(), mono, self.state_dir, usage, steps)

    def look_at(self, pids: dict[int, int]) -> Snapshot:
        """A snapshot of running ranks known only by their pids (rank -> pid), as `ddpkit
        stacks` finds them."""
        views = tuple(
            self._view(rank, pid, None, 0.0, False, False, False)
            for rank, pid in sorted(pids.items())
        )
        return Snapshot(views, time.time(), time.monotonic(), self.state_dir)

    def _view(
        self,
        rank: int,
        pid: int,
        exit_code: int | None,
        ended_wall: float,
        stopped: bool,
        steps: bool,
        usage: bool,
    ) -> RankView:
        folder = self.state_dir
        said = _read(self._path(rank, protocol.PHASE))
        phase, since = protocol.phase_of(said) if said is not None else ("starting", 0.0)
        progress = _read(self._path(rank, protocol.PROGRESS))
        counted = _read(self._path(rank, protocol.COUNT))
        error = self._changed(rank, protocol.ERROR, lambda: protocol.read_error(folder, rank), None)
        memory, snapshot, fault = None, False, ""
        if error is not None or exit_code not in (None, 0):
            memory = self._changed(rank, protocol.MEMORY, lambda: _memory(folder, rank), None)
            snapshot = os.path.exists(self._path(rank, protocol.MEMORY_SNAPSHOT))
        if exit_code is not None and exit_code < 0:  # died of a signal: where, if fatal
            found = _read(self._path(rank, protocol.FAULT))
            fault = found.decode(errors="replace") if found else ""
        cpu, io = -1.0, -1
        if usage and exit_code is None:
            cpu, io, rss = tree_usage(pid)
            self._rss[rank] = rss or self._rss.get(rank, 0)
            self._profiling[rank] = os.path.exists(self._path(rank, protocol.PROFILING))
        return RankView(
            rank=rank,
            pid=pid,
            exit_code=exit_code,
            ended_wall=ended_wall,
            stopped=stopped,
            rss=self._rss.get(rank, 0),
            profiling=self._profiling.get(rank, False),
            cpu=cpu,
            io=io,
            phase=phase,
            phase_since=since,
            record=protocol.record_of(progress) if progress is not None else None,
            error=error,
            error_written=self._mtime(rank, protocol.ERROR) if error is not None else 0.0,
            group=self._changed(
                rank, protocol.GROUP, lambda: protocol.read_group(folder, rank), None
            ),
            ended=self._changed(
                rank, protocol.ENDED, lambda: protocol.read_ended(folder, rank), None
            ),
            memory=memory,
            memory_snapshot=snapshot,
            fault=fault,
            graceful=os.path.exists(self._path(rank, protocol.GRACEFUL)),
            answers=os.path.exists(self._path(rank, protocol.FLIGHT_READY)),
            rescuable=os.path.exists(self._path(rank, protocol.RESCUE_READY)),
            steps=self._steps(rank) if steps else None,
            count=protocol.count_of(counted) if counted is not None else None,
        )

    def _path(self, rank: int, name: str) -> str:
        """A rank's file, its path made once (pathlib's joins were half a look's time)."""
        path = self._paths.get((rank, name))
        if path is None:
            path = self._paths[(rank, name)] = str(protocol.state_path(self.state_dir, rank, name))
        return path

    def _mtime(self, rank: int, name: str) -> float:
        try:
            return os.stat(self._path(rank, name)).st_mtime
        except OSError:
            return 0.0

    def _changed(self, rank: int, name: str, read: Callable[[], T], absent: T) -> T:
        """`read()` again only when the file's modification time or size moved."""
        try:
            found = os.stat(self._path(rank, name))
            stamp = (found.st_mtime_ns, found.st_size)
        except OSError:
            return absent
        kept = self._kept.get((rank, name))
        if kept is not None and kept[0] == stamp:
            return kept[1]  # type: ignore[return-value]
        value = read()
        self._kept[(rank, name)] = (stamp, value)
        return value

    def timed_steps(self, rank: int) -> protocol.StepRecord | None:
        """Every step a rank's step ring holds (a recording's breakdown needs the whole ring,
        not the steps since the last look)."""
        return protocol.read_steps(self.state_dir, rank, since=0)

    def _steps(self, rank: int) -> protocol.StepRecord | None:
        found = protocol.read_steps(self.state_dir, rank, self._steps_read.get(rank, 0))
        if found is not None:
            self._steps_read[rank] = found.count
        return found


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def tree_usage(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, bytes read and written, bytes resident) of a process and its
    descendants. Bytes moved are what their read and write calls moved (files, pipes; not
    sockets)."""
    cpu, io, rss = 0.0, 0, 0
    if pid <= 0:
        return cpu, io, rss
    try:
        for proc in procs.tree(pid):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                cpu += times.user + times.system
            with contextlib.suppress(psutil.Error, AttributeError):
                counters = proc.io_counters()
                io += getattr(counters, "read_chars", counters.read_bytes) + getattr(
                    counters, "write_chars", counters.write_bytes
                )
            with contextlib.suppress(psutil.Error):
                rss += proc.memory_info().rss
    except psutil.Error:
        pass
    return cpu, io, rss


def _memory(state_dir: Path, rank: int) -> protocol.OomFacts | None:
    """The facts a rank wrote at an out-of-memory error (rank/oom_facts.py), or None."""
    try:
        found = json.loads(protocol.state_path(state_dir, rank, protocol.MEMORY).read_text())
    except (OSError, ValueError):
        return None
    # the rank's own JSON, in protocol.OomFacts' shape (the verdict tolerates missing keys)
    return cast("protocol.OomFacts", found) if isinstance(found, dict) else None
