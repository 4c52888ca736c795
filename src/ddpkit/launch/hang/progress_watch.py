"""The hang doctor: tell a stalled job from a busy one, then say which rank is where.

The rule (docs/hang-doctor.md): a rank makes progress in a sampling interval when it finished
a collective, when ddpkit's loader beats (a batch), or when, outside any
collective, its process tree used at least BUSY_SHARE of a core (computing on the CPU, or
feeding and waiting on a GPU, which spins a core). The job is hung when no rank has made
progress for the hang window (ddpkit.launch.hang.window: --hang-min, longer where the job's own
steps are long, never past --hang-timeout). A rank that computes for an hour is not hung; a
rank that sleeps, waits in a collective, or waits on a stuck DataLoader worker is.

Stacks come from inside each rank: the bootstrap registered faulthandler on
protocol.STACKS_SIGNAL, which writes every thread's stack to the rank's stack file even while
the rank is blocked in C code.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from ddpkit.common import protocol
from ddpkit.launch.base.snapshot import RankView, Snapshot
from ddpkit.launch.hang import flight_dumps
from ddpkit.launch.hang.places import GIL_STALE
from ddpkit.launch.hang.window import Learned, Window, learn, window

log = logging.getLogger(__name__)

BUSY_SHARE = 0.10
IO_BYTES_PER_S = 64 * 1024  # a process tree reading or writing this much per second is busy
SAMPLE_EVERY = 1.0
HANG_MIN = 20.0  # --hang-min's default: the soonest a stall is a hang
WAIT_NOTE = 60.0  # a wait this long for a working rank is said (sooner under a lower bound)


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


@dataclass(frozen=True)
class Seen:
    """What the edge read for one look besides the snapshot: the flight recorders' answers
    (when a poll was due), the ranks that wait for their GPU (NVML), the other nodes' last
    progress (monotonic; None with one node) and whether this node decides."""

    flight: dict[int, flight_dumps.Dump | None] = field(default_factory=dict)
    on_gpu: frozenset[int] = frozenset()
    remote_progress: float | None = None
    leads: bool = True


@dataclass(frozen=True)
class Finding:
    """What one look found, and what the edge is to do about it."""

    hung: bool = False
    stall: float = 0.0  # seconds no rank made progress (every node's)
    window: Window | None = None  # the stall that makes a hang, and what it rests on
    progressed: bool = False  # a rank of this node made progress: tell the other nodes
    notes: tuple[str, ...] = ()  # what the user should know (said by the edge)
    waits: Waits | None = None  # a long wait for a working rank, to be described
    ask_flight: tuple[int, ...] = ()  # ranks whose flight recorders to ask for the next poll


@dataclass
class Watch:
    """The hang watch's state between looks. `timeout`: --hang-timeout, the bound (0: off);
    `least`: --hang-min."""

    timeout: float
    least: float = HANG_MIN
    learned: Learned = field(default_factory=Learned)
    ranks: dict[int, RankState] = field(default_factory=dict)
    last_sample: float = 0.0  # monotonic time of the last sampled snapshot judged
    next_flight: float = 0.0
    said_wait: bool = False
    group: tuple[str, float] | None = None  # the process group's, once known
    held_since: float = 0.0  # monotonic time a hang verdict was first held for a late tick

    def flight_due(self, snap: Snapshot) -> bool:
        return self.timeout > 0 and snap.sampled and snap.mono >= self.next_flight

    def copy(self) -> Watch:
        return replace(self, ranks={r: replace(s) for r, s in self.ranks.items()})


def judge(before: Watch, snap: Snapshot, seen: Seen) -> tuple[Watch, Finding]:
    """The watch's step function: the next state and what this look found. No I/O and no
    clock: the times come in the snapshot, the rest in `seen`."""
    if before.timeout <= 0 or not snap.sampled:
        return before, Finding()
    watch, notes = before.copy(), []
    now = snap.mono
    interval = now - watch.last_sample if watch.last_sample else SAMPLE_EVERY
    watch.last_sample = now
    watch.group = watch.group or snap.group()
    for v in snap.ranks:
        watch.ranks.setdefault(v.rank, RankState(last_progress=now, last_compute=now))
    quiet = stalled_for(watch, now, seen.remote_progress)  # up to this look
    ask: tuple[int, ...] = ()
    if now >= watch.next_flight:
        watch.next_flight = now + FLIGHT_EVERY
        ask = _read_flight_recorders(watch, snap, seen)
    for v in snap.ranks:
        state = watch.ranks[v.rank]
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
        on_gpu = v.alive and v.rank in seen.on_gpu
        busy = (
            state.cpu >= 0
            and not inside
            and not held
            and not on_gpu
            and cpu - state.cpu >= BUSY_SHARE * interval
        )
        moved = io - state.io if state.io >= 0 else 0
        prompt = record is not None and record.prompt and v.alive
        if prompt and not state.said_prompt:  # a person debugs this rank: the job waits for them
            state.said_prompt = True
            notes.append(_prompt_note(v, v.group or watch.group))
        state.said_prompt = state.said_prompt and prompt
        if advanced or busy or prompt:
            state.last_progress = state.last_compute = now
            state.io_since, state.said_io = 0, False
        elif record is not None and (held or on_gpu):
            # its last progress was when its tick stopped, or when it began to wait for its
            # GPU: the stall is counted from there, not from when that could first be said
            since = record.ticked if held else record.still
            state.last_progress = min(state.last_progress, now - max(0.0, snap.wall - since))
        elif moved >= IO_BYTES_PER_S * interval:  # a download, a dataset being written
            state.last_progress = now
            state.io_since += moved
            computed = now - state.last_compute
            if computed >= hang_window(watch).seconds and not state.said_io:  # once a stretch
                state.said_io = True
                notes.append(
                    f"rank {v.rank} has done no collective for {computed:.0f} s but its process "
                    f"tree read/wrote {state.io_since / 1e6:.0f} MB: not a hang"
                )
        state.cpu, state.io, state.record = cpu, io, record
    progressed = any(s.last_progress >= now for s in watch.ranks.values())
    stall = stalled_for(watch, now, seen.remote_progress)
    watch.learned = learn(
        watch.learned,
        slowest_steps(snap),
        quiet,
        worked=stall < quiet,
        met=all(v.phase == "ready" for v in snap.ranks),
        completed=any(v.record is not None and v.record.finished for v in snap.ranks),
    )
    limit = hang_window(watch)
    found = Finding(
        stall=stall, window=limit, progressed=progressed, notes=tuple(notes), ask_flight=ask
    )
    if seen.leads and stall >= limit.seconds:
        late = [v.rank for v in snap.running if tick_undecided(v, snap.wall)]
        watch.held_since = watch.held_since or now
        # held until a later look says whether C code holds their GIL; bounded, should a
        # starved machine keep a tick late without end
        if late and now - watch.held_since < GIL_STALE - TICK_LATE:
            log.debug("stalled, but rank(s) %s tick late, not yet decisively: held", late)
            return watch, found
        log.debug("no rank made progress for %.0f s: hung", stall)
        return watch, replace(found, hung=True)
    watch.held_since = 0.0
    return watch, replace(found, waits=_long_wait(watch, now, snap.wall))  # on every node


def _long_wait(watch: Watch, now: float, wall: float) -> Waits | None:
    """Once per episode: some ranks have made no progress for the wait threshold while
    another works. Not a hang; the edge says who waits for whom."""
    quiet = {r: now - s.last_progress for r, s in watch.ranks.items()}
    working = [r for r, q in quiet.items() if q <= 2 * SAMPLE_EVERY]
    if len(working) == len(quiet):
        watch.said_wait = False  # everyone moves again: a new episode may be said
        return None
    if max(quiet.values()) < _wait_threshold(watch):
        return None
    # every rank not working waits, though some came to the wait a sample or two later
    # (a busy machine): named once, all of them, not only the first to pass the threshold
    waiting = [r for r in quiet if r not in working]
    debugged = any(watch.ranks[r].said_prompt for r in working)  # said with the prompt
    if not waiting or not working or debugged or watch.said_wait:
        return None
    watch.said_wait = True
    log.debug("ranks %s wait while ranks %s work: a long wait", waiting, working)
    return Waits(sorted(waiting), sorted(working), wall - max(quiet[r] for r in waiting))


def slowest_steps(snap: Snapshot) -> list[float]:
    """The seconds of each step timed since the last read of the step rings, the slowest
    rank's, in step order (every script's optimizer steps are timed: ddpkit.rank.steps)."""
    slowest: dict[int, float] = {}
    for v in snap.ranks:
        for step in v.steps.steps if v.steps else ():
            slowest[step.number] = max(slowest.get(step.number, 0.0), step.total)
    return [slowest[n] for n in sorted(slowest)]


def hang_window(watch: Watch) -> Window:
    """The stall that makes a hang at this look (ddpkit.launch.hang.window)."""
    nccl = watch.group is not None and watch.group[0] == "nccl"
    return window(watch.learned, watch.least, watch.timeout, nccl)


def _wait_threshold(watch: Watch) -> float:
    """WAIT_NOTE s (--hang-timeout when that is lower), or half the process group's timeout
    when that is shorter, so the note comes before the group's own timeout ends the job."""
    threshold = min(watch.timeout, WAIT_NOTE)
    if watch.group is None:
        return threshold
    return min(threshold, watch.group[1] / 2)


def _prompt_note(view: RankView, group: tuple[str, float] | None) -> str:
    ends = f" ({group[0]}, {group[1]:g} s)" if group else ""
    return (
        f"rank {view.rank} is at a prompt (a debugger's or input()): not a hang; the hang "
        f"watch leaves the job alone while it is there and the other ranks wait for it (the "
        f"process group's timeout{ends} still ends the job if the session outlasts it)"
    )


def _read_flight_recorders(watch: Watch, snap: Snapshot, seen: Seen) -> tuple[int, ...]:
    """NCCL calls return at once and the rank then spins at its next sync, so CPU time says
    nothing: completed sequence numbers advancing is progress, and the same collective pending
    at two polls in a row means the rank is waiting in it. The ranks to ask again."""
    asked = []
    for v in snap.running:
        if not v.answers:
            continue
        state = watch.ranks[v.rank]
        dump = seen.flight.get(v.rank)
        if dump is not None:
            done = flight_dumps.progress_state(dump)
            if state.nccl is not None and done[0] > state.nccl[0]:
                state.last_progress = snap.mono
            if state.backend is None and v.group is not None:
                state.backend = v.group[0]
            state.stuck_in_nccl = waits_in_flight(state.backend, state.nccl, done)
            state.nccl = done
        asked.append(v.rank)
    return tuple(asked)


def stalled_for(watch: Watch, now: float, remote: float | None) -> float:
    """Seconds no rank made progress: this node's, and the other nodes' when there are."""
    local = min((now - s.last_progress for s in watch.ranks.values()), default=0.0)
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
