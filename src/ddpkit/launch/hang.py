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
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ddpkit import protocol
from ddpkit.frames import is_bootstrap, is_framework, is_library, torch_module
from ddpkit.launch import flight
from ddpkit.ranges import ranks_text

BUSY_SHARE = 0.10
IO_BYTES_PER_S = 64 * 1024  # a process tree reading or writing this much per second is busy
SAMPLE_EVERY = 1.0
HANG_EXIT_CODE = 124  # as GNU timeout's


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


class HangWatch:
    """Samples every rank once a second; `hung()` says when no rank progressed for `timeout`."""

    def __init__(
        self, workers: list[Any], state_dir: Path, timeout: float, nodes: Any = None
    ) -> None:
        self.workers = workers
        self.state_dir = state_dir
        self.timeout = timeout
        self.ranks = {w.rank: RankState() for w in workers}
        self.next_sample = 0.0
        self.next_flight = 0.0
        # several nodes: progress is told to `nodes` (a Liveness), and only node 0 decides,
        # from every node's progress
        self.nodes = nodes
        self.notes: list[str] = []  # what the watch saw that the user should know (printed)

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
            cpu, io = tree_usage(w.proc.pid) if w.exit_code is None else (state.cpu, state.io)
            previous = state.record
            advanced = record is not None and (
                previous is None
                or record.finished != previous.finished
                or record.beats != previous.beats
            )
            inside = (record is not None and record.in_collective) or state.stuck_in_nccl
            busy = state.cpu >= 0 and not inside and cpu - state.cpu >= BUSY_SHARE * interval
            moved = io - state.io if state.io >= 0 else 0
            if advanced or busy:
                state.last_progress = state.last_compute = now
                state.io_since, state.said_io = 0, False
            elif moved >= IO_BYTES_PER_S * interval:  # a download, a dataset being written
                state.last_progress = now
                state.io_since += moved
                self._say_io(w.rank, state, now)
            state.cpu, state.io, state.record = cpu, io, record
        if self.nodes is None:
            return self._local_stall(now) >= self.timeout
        if any(s.last_progress >= now for s in self.ranks.values()):
            self.nodes.progressed()
        return self.nodes.node.group_rank == 0 and self.stalled_for(now) >= self.timeout

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
                state.stuck_in_nccl = (
                    seen[1] is not None
                    and state.nccl is not None
                    and seen[1] == state.nccl[1]
                    and seen[0] == state.nccl[0]
                )
                state.nccl = seen
            flight.ask(self.state_dir, w.rank)

    def stalled_for(self, now: float) -> float:
        local = self._local_stall(now)
        if self.nodes is None:
            return local
        return min(local, now - self.nodes.last_remote_progress)


def tree_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, bytes read and written) used so far by a process and its descendants.
    Bytes are what their read and write calls moved (files, pipes; not sockets)."""
    cpu, io = 0.0, 0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                cpu += times.user + times.system
            with contextlib.suppress(psutil.Error, AttributeError):
                counters = proc.io_counters()
                io += getattr(counters, "read_chars", counters.read_bytes) + getattr(
                    counters, "write_chars", counters.write_bytes
                )
    except psutil.Error:
        pass
    return cpu, io


# -- stacks ------------------------------------------------------------------------------


def dump_stacks(
    pids: dict[int, int], state_dir: Path, wait: float = 3.0, stop: Callable[[], bool] = bool
) -> dict[int, str]:
    """Ask each rank (rank -> pid) for its stacks; return rank -> the text it wrote (what came
    before `wait` s passed or `stop()` said to give up)."""
    sizes = {}
    for rank, pid in pids.items():
        path = protocol.state_path(state_dir, rank, protocol.STACKS)
        sizes[rank] = path.stat().st_size if path.exists() else 0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, protocol.STACKS_SIGNAL)
    texts: dict[int, str] = {}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and len(texts) < len(pids) and not stop():
        time.sleep(0.1)
        for rank in pids:
            path = protocol.state_path(state_dir, rank, protocol.STACKS)
            if rank not in texts and path.exists() and path.stat().st_size > sizes[rank]:
                time.sleep(0.1)  # let faulthandler finish writing
                with path.open() as f:
                    f.seek(sizes[rank])
                    texts[rank] = f.read()
    return texts


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def site(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.site} in {self.func}"


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$', re.M)


def parse_threads(text: str) -> list[list[Frame]]:
    """faulthandler's dump -> one list of frames (innermost first) per thread."""
    starts = [m.start() for m in _THREAD.finditer(text)] + [len(text)]
    threads = []
    for begin, end in zip(starts, starts[1:], strict=False):
        frames = [Frame(f, int(n), fn.strip()) for f, n, fn in _FRAME.findall(text[begin:end])]
        if frames:
            threads.append(frames)
    return threads


def main_thread(threads: list[list[Frame]]) -> list[Frame]:
    """The thread running the user's script: its outermost frames are the bootstrap's."""
    for frames in threads:
        if any(is_bootstrap(f.file) for f in frames[-4:]):
            return frames
    return threads[0] if threads else []


def user_frames(frames: list[Frame]) -> list[Frame]:
    """Frames outside torch, ddpkit and Python: the script's, and the frameworks' it runs in."""
    return [f for f in frames if not is_library(f.file)]


def scripts_frames(frames: list[Frame]) -> list[Frame]:
    """The user's own frames: not library code, nor an installed framework's."""
    return [f for f in frames if not is_library(f.file) and not is_framework(f.file)]


def shown_frames(frames: list[Frame], inner: int = 6) -> list[str]:
    """The frames a report shows of a stack, innermost first: the innermost outside torch,
    ddpkit and Python, and every frame of the script's own (a framework's loop can be deep)."""
    outside = user_frames(frames)
    script = set(map(id, scripts_frames(frames)))
    shown = [str(f) for f in outside[:inner]]
    rest = [f for f in outside[inner:] if id(f) in script]
    if rest:
        skipped = len(outside) - inner - len(rest)
        shown += [f"... {skipped} frame(s) of installed packages"] if skipped else []
        shown += [str(f) for f in rest]
    return shown


def code_site(frames: list[Frame]) -> str:
    """Where in the user's code a stack stands: the innermost line of the script; inside a
    framework (Lightning, Trainer), the framework's innermost line and the script's line that
    called into it ('trainer.py:123 in _inner_loop, from train.py:40')."""
    outside = user_frames(frames)
    if not outside:
        return "?"
    innermost = outside[0]
    if not is_framework(innermost.file):
        return innermost.site
    script = scripts_frames(frames)
    return f"{innermost} from {script[0].site}" if script else str(innermost)


def where(
    rank_frames: list[Frame],
    record: protocol.Record | None,
    exit_code: int | None,
    pending: str | None = None,
    hung: bool = False,
) -> tuple[str, str]:
    """(what the rank does, where) for one rank, decided by its stack. The progress record and
    the flight recorder's pending collective are evidence, printed beside the stack; they decide
    only when the rank gave no stack, and an NCCL collective pending through a hang: NCCL
    returns at once, so such a rank's host waits at its next sync, wherever that is."""
    if exit_code is not None:
        return f"has exited (code {exit_code})", ""
    if not rank_frames:
        site = record.site if record is not None else ""
        if record is not None and record.in_collective:
            return f"wait in {record.op}", site
        if pending and hung:
            return f"wait in {pending.split()[0].split(':', 1)[-1]}", site
        return "gave no stack", site
    site = code_site(rank_frames)
    modules = [(f, torch_module(f.file) or "") for f in rank_frames]
    for f, module in modules:
        if f.func in protocol.COLLECTIVES and module.startswith("distributed/"):
            return f"wait in {f.func}", site
    if any(module.startswith("utils/data/") for _, module in modules):
        return "wait for a DataLoader batch", site
    fsdp = [f for f, module in modules if module.startswith("distributed/fsdp/")]
    if fsdp and hung:  # FSDP2 waits for its own collectives inside its hooks
        names = " ".join(f.func for f in fsdp)
        kind = "reduce-scatter" if "reduce" in names or "post_backward" in names else "all-gather"
        return f"wait in FSDP's {kind}", site
    in_backward = any(
        (module == "_tensor.py" and f.func == "backward")
        or (module.startswith("autograd/") and f.func in ("backward", "_engine_run_backward"))
        for f, module in modules
    )
    if in_backward:
        # DDP's reducer all-reduces gradients inside backward: through a hang (no CPU used),
        # that is where the rank waits; in a live job's snapshot, it computes gradients
        return ("wait in all_reduce" if hung else "is in backward"), site
    if pending and hung and pending.startswith("nccl:"):
        return f"wait in {pending.split()[0].split(':', 1)[1]}", site
    innermost = user_frames(rank_frames)
    func = innermost[0].func if innermost else rank_frames[0].func
    return f"is elsewhere: {func}", site


def verdict(places: dict[int, tuple[str, str]], hosts: dict[int, str] | None = None) -> str:
    """'ranks 0,2 wait in all_reduce (train.py:42); rank 1 is elsewhere: f (train.py:17)'; with
    ranks on several hosts, each group says which: 'ranks 0,1 on node0 and 2 on node1 ...'."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, place in sorted(places.items()):
        groups.setdefault(place, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    shown = hosts if hosts is not None and len(set(hosts.values())) > 1 else None
    parts = []
    for (what, site), ranks in ordered:
        who = f"rank{'s' if len(ranks) > 1 else ''} {_on_hosts(ranks, shown)}"
        verb = re.sub(r"^is\b", "are", what) if len(ranks) > 1 else _singular(what)
        parts.append(f"{who} {verb}" + (f" ({site})" if site else ""))
    return "; ".join(parts)


def _on_hosts(ranks: list[int], hosts: dict[int, str] | None) -> str:
    if hosts is None:
        return ranks_text(ranks)
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts.get(rank, "?"), []).append(rank)
    return " and ".join(f"{ranks_text(rs)} on {host}" for host, rs in by_host.items())


def _singular(what: str) -> str:
    return re.sub(r"^wait\b", "waits", what)


def collect(
    workers: list[Any], state_dir: Path, hung: bool = True, stop: Callable[[], bool] = bool
) -> tuple[dict[int, tuple[str, str]], str]:
    """Collect stacks and records of this node's ranks: rank -> (what, where), and details:
    each rank's stack, then the evidence beside it (its progress record, its flight recorder).
    hung=False reads a live job (`ddpkit stacks`): a rank in backward computes there."""
    alive = {w.rank: w.proc.pid for w in workers if w.exit_code is None}
    texts = dump_stacks(alive, state_dir, stop=stop)  # stop: a signal cuts the waits short
    served = [r for r in alive if flight.ready_file(state_dir, r).exists()]
    recorded = flight.request(served, state_dir, stop=stop) if served and not stop() else {}
    places, details = {}, []
    for w in workers:
        record = protocol.read_record(state_dir, w.rank)
        frames = main_thread(parse_threads(texts.get(w.rank, "")))
        in_flight = flight.pending(recorded[w.rank]) if w.rank in recorded else None
        places[w.rank] = where(frames, record, w.exit_code, in_flight, hung)
        what, site = places[w.rank]
        details.append(f"  rank {w.rank} {_singular(what)}" + (f" at {site}" if site else ""))
        details.extend(f"    {f}" for f in shown_frames(frames))
        if record is not None and record.in_collective:
            shapes = f" with shapes {record.shapes}" if record.shapes else ""
            details.append(
                f"    progress record: in {record.op}{shapes} since "
                f"{time.time() - record.since:.0f} s, called at {record.site}"
            )
        elif record is not None and record.op:
            details.append(
                f"    progress record: last collective {record.op} at {record.site} (returned)"
            )
        if w.rank in recorded:
            if in_flight:
                details.append(f"    flight recorder: not completed: {in_flight}")
            details.extend(
                f"    flight recorder: {line}" for line in flight.summarize(recorded[w.rank])
            )
        if w.rank in alive and w.rank not in texts:
            details.append("    (no stack: the rank did not answer the stack request)")
    return places, "\n".join(details)


def describe(
    workers: list[Any],
    state_dir: Path,
    stall: float,
    hung: bool = True,
    stop: Callable[[], bool] = bool,
) -> tuple[str, str]:
    """(verdict line, details with per-rank stacks) for this node's ranks."""
    places, details = collect(workers, state_dir, hung, stop)
    if not hung:
        return verdict(places), details
    return f"no rank made progress for {stall:.0f} s: {verdict(places)}", details
