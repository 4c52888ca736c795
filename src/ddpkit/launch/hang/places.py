"""Where each rank is: its stack (faulthandler's dump, asked for with a signal, answered even
while the rank is blocked in C code), what it does there (waits in a collective, is in its own
code, holds the GIL in C code, is stopped), and the one-line verdict that groups the ranks
('ranks 0,2 wait in all_reduce (train.py:42); rank 1 is elsewhere: stuck_here (train.py:17)').

The hang doctor (`hang.py`), the long-wait note, the root cause of a timeout and `ddpkit
stacks` all read ranks through here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ddpkit.common import protocol
from ddpkit.common.frames import (
    Frame,
    code_site,
    main_thread,
    parse_threads,
    shown_frames,
    torch_module,
    user_frames,
)
from ddpkit.common.ranges import ranks_text
from ddpkit.launch.base import asking
from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.hang import flight_dumps
from ddpkit.launch.hang.mismatch import Call

GIL_STALE = 5.0  # seconds without a tick from a live, unstopped rank: C code holds its GIL


def dump_stacks(
    pids: dict[int, int], state_dir: Path, wait: Wait, seconds: float = 3.0
) -> dict[int, str]:
    """Ask each rank (rank -> pid) for its stacks; return rank -> the text it wrote (what came
    within `seconds`, or before `wait` gave up)."""
    return asking.collect(
        asking.STACKS, state_dir, pids, wait, seconds, lambda b: b.decode(errors="replace")
    )


def where(
    rank_frames: list[Frame],
    record: protocol.Record | None,
    exit_code: int | None,
    pending: str | None = None,
    hung: bool = False,
    state: Place | None = None,
) -> Place:
    """Where one rank is, decided by its stack. The progress record and the flight recorder's
    pending collective are evidence, printed beside the stack; they decide only when the rank
    gave no stack, and an NCCL collective pending through a hang: NCCL returns at once, so such
    a rank's host waits at its next sync, wherever that is. `state` (from `process_state`)
    names a rank that is stopped, holds the GIL in C code or waits for its GPU."""
    if exit_code is not None:
        return Place(Doing.EXITED, code=exit_code)
    stack_site = code_site(rank_frames)
    modules = [(f, torch_module(f.file) or "") for f in rank_frames]
    if (
        state is not None
        and state.doing is Doing.WAITS_FOR_GPU
        and hung
        and pending
        and pending.startswith("nccl:")
        and "(scheduled)" not in pending
    ):
        # NCCL's kernel has started (the launcher turns NCCL's timing on, so the flight recorder
        # tells started from scheduled): the rank waits in that collective for a peer. One
        # still scheduled sits behind the rank's own GPU work, which is what never finishes.
        return Place(Doing.WAITS_IN, stack_site, op=_pending_op(pending))
    if state is not None:  # stopped, stuck in C code holding the GIL, waiting for its GPU
        if state.doing is Doing.HOLDS_GIL and rank_frames:
            state = Place(Doing.HOLDS_GIL, seconds=state.seconds, func=rank_frames[0].func)
        return state.at(stack_site if rank_frames else (record.site if record else ""))
    if not rank_frames:
        site = record.site if record is not None else ""
        if record is not None and record.in_collective:
            return Place(Doing.WAITS_IN, site, op=record.op)
        if pending and hung:
            return Place(Doing.WAITS_IN, site, op=_pending_op(pending))
        return Place(Doing.NO_STACK, site)
    site = stack_site
    for f, module in modules:
        if f.func in protocol.COLLECTIVES and module.startswith("distributed/"):
            return Place(Doing.WAITS_IN, site, op=f.func)
        if f.func == "init_process_group" and module.startswith("distributed/"):
            return Place(Doing.IN_INIT, site)
    if any(module.startswith("utils/data/") for _, module in modules):
        return Place(Doing.WAITS_FOR_BATCH, site)
    fsdp = [f for f, module in modules if module.startswith("distributed/fsdp/")]
    if fsdp and hung:  # FSDP2 waits for its own collectives inside its hooks
        names = " ".join(f.func for f in fsdp)
        kind = "reduce-scatter" if "reduce" in names or "post_backward" in names else "all-gather"
        return Place(Doing.WAITS_IN, site, op=f"FSDP's {kind}")
    in_backward = any(
        (module == "_tensor.py" and f.func == "backward")
        or (module.startswith("autograd/") and f.func in ("backward", "_engine_run_backward"))
        for f, module in modules
    )
    if in_backward:
        # DDP's reducer all-reduces gradients inside backward: through a hang (no CPU used),
        # that is where the rank waits; in a live job's snapshot, it computes gradients
        return (
            Place(Doing.WAITS_IN, site, op="all_reduce") if hung else Place(Doing.IN_BACKWARD, site)
        )
    if pending and hung and pending.startswith("nccl:"):
        return Place(Doing.WAITS_IN, site, op=_pending_op(pending))
    innermost = user_frames(rank_frames) or rank_frames
    # a comprehension or generator is part of the function that holds it: name that one
    named = [f for f in innermost if f.func in ("<module>",) or not f.func.startswith("<")]
    return Place(Doing.ELSEWHERE, site, func=(named or innermost)[0].func)


def _pending_op(pending: str) -> str:
    """'all_reduce' of the flight recorder's 'nccl:all_reduce #6 (started)'."""
    return pending.split()[0].split(":", 1)[-1]


def verdict(places: dict[int, Place], hosts: dict[int, str] | None = None) -> str:
    """'ranks 0,2 wait in all_reduce (train.py:42); rank 1 is elsewhere: f (train.py:17)'; with
    ranks on several hosts, each group says which: 'ranks 0,1 on node0 and 2 on node1 ...'."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, place in sorted(places.items()):
        groups.setdefault((place.words(ranks=2), place.site), []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    shown = hosts if hosts is not None and len(set(hosts.values())) > 1 else None
    parts = []
    for (_, site), ranks in ordered:
        who = f"rank{'s' if len(ranks) > 1 else ''} {_on_hosts(ranks, shown)}"
        said = places[ranks[0]].words(len(ranks))
        parts.append(f"{who} {said}" + (f" ({site})" if site else ""))
    return "; ".join(parts)


def _on_hosts(ranks: list[int], hosts: dict[int, str] | None) -> str:
    if hosts is None:
        return ranks_text(ranks)
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts.get(rank, "?"), []).append(rank)
    return " and ".join(f"{ranks_text(rs)} on {host}" for host, rs in by_host.items())


@dataclass(frozen=True)
class Evidence:
    places: dict[int, Place]
    details: str  # each rank's stack and the evidence beside it, for the report
    calls: dict[int, Call]  # rank -> the collective it waits in, as its records say


def collect(
    snap: Snapshot,
    hung: bool | set[int] = True,
    wait: Wait | None = None,
) -> tuple[dict[int, Place], str]:
    """Collect stacks and records of this node's ranks: rank -> its place, and details:
    each rank's stack, then the evidence beside it (its progress record, its flight recorder).
    hung=False reads a live job (`ddpkit stacks`): a rank in backward computes there; a set
    names the ranks that are known to wait."""
    found = evidence(snap, hung, wait)
    return found.places, found.details


def evidence(
    snap: Snapshot,
    hung: bool | set[int] = True,
    wait: Wait | None = None,
) -> Evidence:
    """`collect`, with the collective each waiting rank is in (for `mismatch.find`)."""
    state_dir = snap.state_dir
    alive = {v.rank: v.pid for v in snap.running}
    states = {v.rank: process_state(v.pid, v.record) for v in snap.running}
    # a stopped rank answers nothing, and one stuck holding the GIL only faulthandler's (C)
    # stack request: nobody waits for answers that cannot come
    answering = {r: pid for r, pid in alive.items() if not _stopped(states[r])}
    wait = wait or Wait()  # a signal (or a lost peer) cuts the waits short
    texts = dump_stacks(answering, state_dir, wait)
    served = [r for r in answering if snap.of(r).answers and not _holds_gil(states[r])]
    recorded = (
        flight_dumps.request(served, state_dir, wait) if served and not wait.cancelled else {}
    )
    flights = {r: flight_dumps.read(dump) for r, dump in recorded.items()}
    places, details, calls = {}, [], {}
    for w in snap.ranks:
        record, flight = w.record, flights.get(w.rank)
        frames = main_thread(parse_threads(texts.get(w.rank, "")))
        shown = shown_frames(frames)
        in_flight = flight.pending if flight is not None else None
        state = states.get(w.rank)
        waits = hung if isinstance(hung, bool) else w.rank in hung
        place = places[w.rank] = where(frames, record, w.exit_code, in_flight, waits, state)
        call = waiting_call(w.rank, place, record, flight)
        if call is not None:
            calls[w.rank] = call
        details.append(
            f"  rank {w.rank} {place.words()}" + (f" at {place.site}" if place.site else "")
        )
        details.extend(f"    {f}" for f in shown)
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
        if flight is not None:
            if in_flight:
                details.append(f"    flight recorder: not completed: {in_flight}")
            details.extend(f"    flight recorder: {line}" for line in flight.lines)
        if w.rank in alive and w.rank not in texts:
            why = "it is stopped: a stopped process runs no handler" if _stopped(state) else ""
            details.append(
                f"    (no stack: {why})" if why else "    (no stack: the rank did not answer)"
            )
    return Evidence(places, "\n".join(details), calls)


def waiting_call(
    rank: int, place: Place, record: protocol.Record | None, flight: flight_dumps.Flight | None
) -> Call | None:
    """The collective a rank waits in, with its shapes (progress record) and sequence number
    (flight recorder) where they say the same collective."""
    op = place.collective
    if op is None:
        return None
    shapes = (
        record.shapes if record is not None and record.in_collective and record.op == op else ""
    )
    seq = None
    if flight is not None and flight.op == op:
        seq = flight.seq
        shapes = shapes or flight.shapes
    return Call(rank, op, place.site, shapes, seq)


def calls_of(places: dict[int, Place], local: dict[int, Call]) -> list[Call] | None:
    """Every rank's collective, when every rank waits in one (this node's with their records,
    another node's from its place alone); None when a rank does something else."""
    calls = []
    for rank, place in sorted(places.items()):
        call = local.get(rank) or waiting_call(rank, place, None, None)
        if call is None:
            return None
        calls.append(call)
    return calls


def describe(
    snap: Snapshot,
    stall: float,
    hung: bool = True,
    wait: Wait | None = None,
) -> tuple[str, str]:
    """(verdict line, details with per-rank stacks) for this node's ranks."""
    places, details = collect(snap, hung, wait)
    if not hung:
        return verdict(places), details
    return f"no rank made progress for {stall:.0f} s: {verdict(places)}", details


def _stopped(state: Place | None) -> bool:
    return state is not None and state.stopped


def _holds_gil(state: Place | None) -> bool:
    return state is not None and state.doing is Doing.HOLDS_GIL


def process_state(pid: int, record: protocol.Record | None) -> Place | None:
    """What stops a live rank from running Python, when something does: a stop signal or a
    debugger, a debugger's prompt, C code that holds the GIL (its tick thread has not run for
    GIL_STALE s), or its GPU. None for a rank that runs."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return None
    tracer = _tracer(pid)
    if tracer and status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return Place(Doing.TRACED, tracer=tracer)
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return Place(Doing.STOPPED, pid=pid)
    if record is not None and record.prompt:
        return Place(Doing.AT_PROMPT)
    if record is not None and record.ticked and time.time() - record.ticked > GIL_STALE:
        return Place(Doing.HOLDS_GIL, seconds=time.time() - record.ticked)
    return gpu_wait(record)


GPU_STILL = 2.0  # seconds a GPU rank's thread stands in one call, no allocation, to be waiting


def gpu_wait(record: protocol.Record | None, now: float | None = None) -> Place | None:
    """'waits for GPU 0, busy for 40 s with no step ended (100% utilised)': a rank whose
    script stands in one call (a sync: loss.item(), .cpu(), synchronize) while its GPU runs
    and no new GPU allocation is made; None otherwise. A GPU that reads idle (NVML) means the
    call is something else (CPU work in C), which is not this."""
    now = time.time() if now is None else now
    if record is None or not record.gpu or not record.still or now - record.still < GPU_STILL:
        return None
    if record.in_collective:  # it stands in a collective: it waits for a peer, not its GPU
        return None
    from ddpkit.common.gpus import utilization

    seen = utilization(record.gpu)
    waited = now - record.still
    if seen is None:
        return Place(Doing.WAITS_FOR_GPU, seconds=waited)
    index, busy = seen
    if busy <= 0:
        return None
    return Place(Doing.WAITS_FOR_GPU, seconds=waited, gpu=index, busy=busy)


def _tracer(pid: int) -> str:
    """'77 (gdb)' when a debugger or tracer (gdb, strace, py-spy dump) is attached."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    tracer = int(line.split()[1])
                    if not tracer:
                        return ""
                    with contextlib.suppress(psutil.Error):
                        return f"{tracer} ({psutil.Process(tracer).name()})"
                    return str(tracer)
    except (OSError, ValueError):
        pass
    return ""


def long_wait_note(
    snap: Snapshot,
    waiting: list[int],
    working: list[int],
    began: float,
    wait: Wait | None = None,
) -> str:
    """What to say, once, when ranks have waited long for others that still work: who waits
    where, who works where, and when the process group's own timeout would end the job."""
    places, _ = collect(snap, hung=set(waiting), wait=wait)
    waited = time.time() - began
    who = verdict({r: places[r] for r in waiting})
    busy = verdict({r: places[r] for r in working})
    line = f"{who}, for {waited:.0f} s now; {busy}, still working: not a hang, the job goes on."
    group = next((v.group for v in snap.only(waiting) if v.group is not None), None)
    if group is not None:
        backend, timeout = group
        ends = began + timeout
        clock = time.strftime("%H:%M:%S", time.localtime(ends))
        line += (
            f" The process group's timeout ({backend}, {timeout:g} s) ends the job at "
            f"{clock} (in {max(0, ends - time.time()):.0f} s) if the wait lasts: raise it "
            "(ddpkit.setup(timeout=...), init_process_group(timeout=...)) or share the work "
            "across ranks (each rank evaluates its part)."
        )
    return line
