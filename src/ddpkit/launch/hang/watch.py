"""The hang doctor: tell a stalled job from a busy one, then say which rank is where.

The rule (docs/hang-doctor.md): a rank makes progress in a sampling interval when it finished
a collective, when ddpkit's loader beats (a batch), or when, outside any
collective, its process tree used at least BUSY_SHARE of a core (computing on the CPU, or
feeding and waiting on a GPU, which spins a core). The job is hung when no rank has made
progress for the hang timeout. A rank that computes for an hour is not hung; a rank that
sleeps, waits in a collective, or waits on a stuck DataLoader worker is.

Stacks come from inside each rank: the bootstrap registered faulthandler on
protocol.STACKS_SIGNAL, which writes every thread's stack to the rank's stack file even while
the rank is blocked in C code.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ddpkit.common import procs, protocol
from ddpkit.launch.hang import flight, places
from ddpkit.launch.hang.places import GIL_STALE
from ddpkit.launch.report import HANG_EXIT_CODE  # noqa: F401 - where callers find it

BUSY_SHARE = 0.10
IO_BYTES_PER_S = 64 * 1024  # a process tree reading or writing this much per second is busy
SAMPLE_EVERY = 1.0


FLIGHT_EVERY = 2.0  # seconds between flight-recorder polls of NCCL ranks


@dataclass
class RankState:
    cpu: float = -1.0
    io: int = -1  # bytes the process tree has read and written so far
    record: protocol.Record | None = None
    last_progress: float = field(default_factory=time.monotonic)
    last_compute: float = field(default_factory=time.monotonic)  # progress other than I/O
    io_since: int = 0  # bytes moved since last_compute
    said_io: bool = False
    nccl: tuple[int, int | None] | None = None  # (last completed seq, oldest pending seq)
    stuck_in_nccl: bool = False
    backend: str | None = None  # its process group's, read once the rank wrote it
    said_prompt: bool = False  # its debugger prompt was said (once per visit)


@dataclass(frozen=True)
class Waits:
    """Ranks that have waited, since `began` (wall clock), while `working` ranks work."""

    waiting: list[int]
    working: list[int]
    began: float


class HangWatch:
    """Samples every rank once a second; `hung()` says when no rank progressed for `timeout`."""

    def __init__(self, workers: list[Any], state_dir: Path, timeout: float, peers: Any) -> None:
        self.workers = workers
        self.state_dir = state_dir
        self.timeout = timeout
        self.ranks = {w.rank: RankState() for w in workers}
        self.next_sample = 0.0
        self.next_flight = 0.0
        # progress is told to the peers (the other nodes), and only the leading node (node 0,
        # or the only one) decides, from every node's progress
        self.peers = peers
        self.notes: list[str] = []  # what the watch saw that the user should know (printed)
        self.waits: Waits | None = None  # a long wait for a working rank, to be described
        self.said_wait = False

    def hung(self, now: float) -> bool:
        if self.timeout <= 0 or now < self.next_sample:
            return False
        interval = now - (self.next_sample - SAMPLE_EVERY) if self.next_sample else SAMPLE_EVERY
        self.next_sample = now + SAMPLE_EVERY
        if now >= self.next_flight:
            self.next_flight = now + FLIGHT_EVERY
            self._poll_flight_recorders(now)
        for w in self.workers:
            state = self.ranks[w.rank]
            record = protocol.read_record(self.state_dir, w.rank)
            if w.exit_code is None:
                cpu, io, rss = tree_usage(w.proc.pid)
                w.rss = rss or w.rss
            else:
                cpu, io = state.cpu, state.io
            previous = state.record
            advanced = record is not None and (
                previous is None
                or record.finished != previous.finished
                or record.beats != previous.beats
            )
            inside = (record is not None and record.in_collective) or state.stuck_in_nccl
            # CPU burnt while C code holds the GIL (no Python thread runs) is no progress, nor
            # CPU spun in CUDA's wait for a GPU that never finishes
            held = holds_gil(self.state_dir, w.rank, record)
            on_gpu = w.exit_code is None and places.gpu_wait(record) is not None
            busy = (
                state.cpu >= 0
                and not inside
                and not held
                and not on_gpu
                and cpu - state.cpu >= BUSY_SHARE * interval
            )
            moved = io - state.io if state.io >= 0 else 0
            prompt = record is not None and record.prompt and w.exit_code is None
            if prompt:  # a person is debugging this rank: the job waits for them, not hung
                self._say_prompt(w.rank, state)
            state.said_prompt = state.said_prompt and prompt
            if advanced or busy or prompt:
                state.last_progress = state.last_compute = now
                state.io_since, state.said_io = 0, False
            elif moved >= IO_BYTES_PER_S * interval:  # a download, a dataset being written
                state.last_progress = now
                state.io_since += moved
                self._say_io(w.rank, state, now)
            state.cpu, state.io, state.record = cpu, io, record
        if any(s.last_progress >= now for s in self.ranks.values()):
            self.peers.progressed()
        if self.peers.leads and self.stalled_for(now) >= self.timeout:
            return True
        self._watch_waits(now)  # this node's ranks, on every node
        return False

    def _watch_waits(self, now: float) -> None:
        """Once per episode: some ranks have made no progress for the wait threshold while
        another works. Not a hang; the supervisor says who waits for whom (`waits`)."""
        quiet = {r: now - s.last_progress for r, s in self.ranks.items()}
        working = [r for r, q in quiet.items() if q <= 2 * SAMPLE_EVERY]
        if len(working) == len(quiet):
            self.said_wait = False  # everyone moves again: a new episode may be said
            return
        waiting = [r for r, q in quiet.items() if q >= self._wait_threshold()]
        debugged = any(self.ranks[r].said_prompt for r in working)  # said with the prompt
        if waiting and working and not debugged and not self.said_wait and self.waits is None:
            self.said_wait = True
            began = time.time() - max(quiet[r] for r in waiting)
            self.waits = Waits(sorted(waiting), sorted(working), began)

    def _wait_threshold(self) -> float:
        """--hang-timeout, or half the process group's timeout when that is shorter, so the
        note comes before the group's own timeout ends the job."""
        group = next(
            (g for w in self.workers if (g := protocol.read_group(self.state_dir, w.rank))),
            None,
        )
        if group is None:
            return self.timeout
        return min(self.timeout, group[1] / 2)

    def _say_io(self, rank: int, state: RankState, now: float) -> None:
        """Once per stretch: a rank kept alive only by its I/O, where the watch would have
        called the job hung."""
        quiet = now - state.last_compute
        if quiet >= self.timeout and not state.said_io:
            state.said_io = True
            self.notes.append(
                f"rank {rank} has done no collective for {quiet:.0f} s but its process tree "
                f"read/wrote {state.io_since / 1e6:.0f} MB: not a hang"
            )

    def _say_prompt(self, rank: int, state: RankState) -> None:
        if state.said_prompt:
            return
        state.said_prompt = True
        group = protocol.read_group(self.state_dir, rank)
        ends = f" ({group[0]}, {group[1]:g} s)" if group else ""
        self.notes.append(
            f"rank {rank} is at a debugger prompt (pdb): not a hang; the hang watch leaves the "
            f"job alone while it is there and the other ranks wait for it (the process group's "
            f"timeout{ends} still ends the job if the session outlasts it)"
        )

    def _local_stall(self, now: float) -> float:
        return min(now - s.last_progress for s in self.ranks.values())

    def _poll_flight_recorders(self, now: float) -> None:
        """NCCL calls return at once and the rank then spins at its next sync, so CPU time
        says nothing: completed sequence numbers advancing is progress, and the same
        collective pending at two polls in a row means the rank is waiting in it."""
        for w in self.workers:
            if w.exit_code is not None or not flight.ready_file(self.state_dir, w.rank).exists():
                continue
            state = self.ranks[w.rank]
            dump = flight.answer(self.state_dir, w.rank)
            if dump is not None:
                seen = flight.progress_state(dump)
                if state.nccl is not None and seen[0] > state.nccl[0]:
                    state.last_progress = now
                if state.backend is None:
                    group = protocol.read_group(self.state_dir, w.rank)
                    state.backend = group[0] if group else None
                state.stuck_in_nccl = waits_in_flight(state.backend, state.nccl, seen)
                state.nccl = seen
            flight.ask(self.state_dir, w.rank)

    def stalled_for(self, now: float) -> float:
        local = self._local_stall(now)
        remote = self.peers.last_remote_progress()  # None: no other node
        return local if remote is None else min(local, now - remote)


def waits_in_flight(
    backend: str | None, before: tuple[int, Any] | None, seen: tuple[int, Any]
) -> bool:
    """A rank waits in a collective by its flight recorder: the same collective pending at two
    polls in a row, none completed between them. NCCL ranks only: gloo's recorder can count a
    collective completed late (a rank that had returned from DDP's all_reduce and computed for
    9 s still showed it pending, and was called hung), and a gloo rank's progress record and
    CPU time already say whether it waits or works."""
    return backend == "nccl" and before is not None and seen[1] is not None and seen == before


def holds_gil(state_dir: Path, rank: int, record: protocol.Record | None) -> bool:
    """The rank's tick thread has not run for GIL_STALE s since it joined the job (start-up is
    left out: loading torch's libraries holds the GIL for seconds on a loaded machine)."""
    if record is None or not record.ticked or time.time() - record.ticked <= GIL_STALE:
        return False
    return protocol.read_phase(state_dir, rank)[0] in ("init", "ready")


def tree_usage(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, bytes read and written, bytes resident) of a process and its
    descendants. Bytes moved are what their read and write calls moved (files, pipes; not
    sockets)."""
    cpu, io, rss = 0.0, 0, 0
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
