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

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.launch.base.snapshot import RankView, Snapshot
from ddpkit.launch.hang import flight_dumps, places
from ddpkit.launch.hang.places import GIL_STALE
from ddpkit.launch.peers.peers import Peers

log = logging.getLogger(__name__)

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
    nccl: tuple[int, object] | None = None  # (last completed seq, oldest pending seq)
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
    """Judges every sampled snapshot (once a second); `hung()` says when no rank progressed
    for `timeout`."""

    def __init__(self, state_dir: Path, timeout: float, peers: Peers) -> None:
        self.state_dir = state_dir  # where the flight recorders are asked and answer
        self.timeout = timeout
        self.ranks: dict[int, RankState] = {}
        self.last_sample = 0.0  # monotonic time of the last sampled snapshot judged
        self.next_flight = 0.0
        # progress is told to the peers (the other nodes), and only the leading node (node 0,
        # or the only one) decides, from every node's progress
        self.peers = peers
        self.notes: list[str] = []  # what the watch saw that the user should know (printed)
        self.waits: Waits | None = None  # a long wait for a working rank, to be described
        self.said_wait = False
        self.group: tuple[str, float] | None = None  # the process group's, once known
        self.held_since = 0.0  # monotonic time a hang verdict was first held for a late tick

    def hung(self, snap: Snapshot) -> bool:
        if self.timeout <= 0 or not snap.sampled:
            return False
        now = snap.mono
        interval = now - self.last_sample if self.last_sample else SAMPLE_EVERY
        self.last_sample = now
        self.group = self.group or snap.group()
        for v in snap.ranks:
            self.ranks.setdefault(v.rank, RankState())
        if now >= self.next_flight:
            self.next_flight = now + FLIGHT_EVERY
            self._poll_flight_recorders(snap)
        for v in snap.ranks:
            state = self.ranks[v.rank]
            record = v.record
            cpu, io = (v.cpu, v.io) if v.alive else (state.cpu, state.io)
            previous = state.record
            advanced = record is not None and (
                previous is None
                or record.finished != previous.finished
                or record.beats != previous.beats
            )
            inside = (record is not None and record.in_collective) or state.stuck_in_nccl
            # CPU burnt while C code holds the GIL (no Python thread runs) is no progress, nor
            # CPU spun in CUDA's wait for a GPU that never finishes
            held = holds_gil(v, snap.wall)
            on_gpu = v.alive and places.gpu_wait(record) is not None
            busy = (
                state.cpu >= 0
                and not inside
                and not held
                and not on_gpu
                and cpu - state.cpu >= BUSY_SHARE * interval
            )
            moved = io - state.io if state.io >= 0 else 0
            prompt = record is not None and record.prompt and v.alive
            if prompt:  # a person is debugging this rank: the job waits for them, not hung
                self._say_prompt(v)
            state.said_prompt = state.said_prompt and prompt
            if advanced or busy or prompt:
                state.last_progress = state.last_compute = now
                state.io_since, state.said_io = 0, False
            elif moved >= IO_BYTES_PER_S * interval:  # a download, a dataset being written
                state.last_progress = now
                state.io_since += moved
                self._say_io(v.rank, state, now)
            state.cpu, state.io, state.record = cpu, io, record
        if any(s.last_progress >= now for s in self.ranks.values()):
            self.peers.progressed()
        if self.peers.leads and self.stalled_for(now) >= self.timeout:
            late = [v.rank for v in snap.running if tick_undecided(v, snap.wall)]
            self.held_since = self.held_since or now
            # held until a later look says whether C code holds their GIL; bounded, should a
            # starved machine keep a tick late without end
            if late and now - self.held_since < GIL_STALE - TICK_LATE:
                log.debug("stalled, but rank(s) %s tick late, not yet decisively: held", late)
                return False
            log.debug("no rank made progress for %.0f s: hung", self.stalled_for(now))
            return True
        self.held_since = 0.0
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
        if max(quiet.values()) < self._wait_threshold():
            return
        # every rank not working waits, though some came to the wait a sample or two later
        # (a busy machine): named once, all of them, not only the first to pass the threshold
        waiting = [r for r in quiet if r not in working]
        debugged = any(self.ranks[r].said_prompt for r in working)  # said with the prompt
        if waiting and working and not debugged and not self.said_wait and self.waits is None:
            self.said_wait = True
            began = time.time() - max(quiet[r] for r in waiting)
            self.waits = Waits(sorted(waiting), sorted(working), began)
            log.debug("ranks %s wait while ranks %s work: a long wait", waiting, working)

    def _wait_threshold(self) -> float:
        """--hang-timeout, or half the process group's timeout when that is shorter, so the
        note comes before the group's own timeout ends the job."""
        if self.group is None:
            return self.timeout
        return min(self.timeout, self.group[1] / 2)

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

    def _say_prompt(self, view: RankView) -> None:
        state = self.ranks[view.rank]
        if state.said_prompt:
            return
        state.said_prompt = True
        group = view.group or self.group
        ends = f" ({group[0]}, {group[1]:g} s)" if group else ""
        self.notes.append(
            f"rank {view.rank} is at a debugger prompt (pdb): not a hang; the hang watch leaves "
            f"the job alone while it is there and the other ranks wait for it (the process "
            f"group's timeout{ends} still ends the job if the session outlasts it)"
        )

    def _local_stall(self, now: float) -> float:
        return min((now - s.last_progress for s in self.ranks.values()), default=0.0)

    def _poll_flight_recorders(self, snap: Snapshot) -> None:
        """NCCL calls return at once and the rank then spins at its next sync, so CPU time
        says nothing: completed sequence numbers advancing is progress, and the same
        collective pending at two polls in a row means the rank is waiting in it."""
        for v in snap.running:
            if not v.answers:
                continue
            state = self.ranks[v.rank]
            dump = flight_dumps.answer(self.state_dir, v.rank)
            if dump is not None:
                seen = flight_dumps.progress_state(dump)
                if state.nccl is not None and seen[0] > state.nccl[0]:
                    state.last_progress = snap.mono
                if state.backend is None and v.group is not None:
                    state.backend = v.group[0]
                state.stuck_in_nccl = waits_in_flight(state.backend, state.nccl, seen)
                state.nccl = seen
            flight_dumps.ask(self.state_dir, v.rank)

    def stalled_for(self, now: float) -> float:
        local = self._local_stall(now)
        remote = self.peers.last_remote_progress()  # None: no other node
        return local if remote is None else min(local, now - remote)


def waits_in_flight(
    backend: str | None, before: tuple[int, object] | None, seen: tuple[int, object]
) -> bool:
    """A rank waits in a collective by its flight recorder: the same collective pending at two
    polls in a row, none completed between them. NCCL ranks only: gloo's recorder can count a
    collective completed late (a rank that had returned from DDP's all_reduce and computed for
    9 s still showed it pending, and was called hung), and a gloo rank's progress record and
    CPU time already say whether it waits or works."""
    return backend == "nccl" and before is not None and seen[1] is not None and seen == before


TICK_LATE = 3 * protocol.TICK_EVERY  # a tick this late is no longer scheduling's delay


def tick_age(view: RankView, now: float) -> float | None:
    """Seconds since the rank's tick thread last ran, once the rank joined the job (start-up is
    left out: loading torch's libraries holds the GIL for seconds on a loaded machine); None for
    a rank that does not tick or has not joined."""
    record = view.record
    if record is None or not record.ticked or view.phase not in ("init", "ready"):
        return None
    return now - record.ticked


def tick_undecided(view: RankView, now: float) -> bool:
    """The rank's tick is late, but not yet GIL_STALE: whether C code holds its GIL cannot be
    said yet. A hang verdict waits for it (at most GIL_STALE - TICK_LATE s): read too early, a
    rank stuck in a regex under a short --hang-timeout was said to be 'elsewhere' (CI, on a
    machine loaded enough that its burnt CPU did not count as busy)."""
    age = tick_age(view, now)
    return view.alive and age is not None and TICK_LATE < age <= GIL_STALE


def holds_gil(view: RankView, now: float) -> bool:
    """The rank's tick thread has not run for GIL_STALE s since it joined the job."""
    age = tick_age(view, now)
    return age is not None and age > GIL_STALE
