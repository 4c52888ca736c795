"""The launcher's side of the flight recorder: ask ranks for dumps and read what they say.

Each rank that has a process group answers requests (`ddpkit.rank.flight_answers`); `request` asks
every rank and reads what came back. Torch builds without the recorder, or a rank whose Python
cannot run, give none, and the verdict goes on from stacks alone.

The hang watch polls every 2 s, so its poll asks only for each process group's status (last
enqueued and completed sequence numbers): 0.1 ms. A dump with the collectives took 10.75 ms
on an H200 rank with a full ring, and a training step it overlapped ran 17.8 ms slower
(benchmarks/RESULTS.md), so the full dump is kept for the hang report.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.launch.base import asking
from ddpkit.launch.base.wait import Wait

# A rank's flight-recorder dump: torch's pickle (entries, pg_status, ...), untyped by torch
Dump = dict[str, Any]


def request(ranks: list[int], state_dir: Path, wait: Wait, seconds: float = 8.0) -> dict[int, Dump]:
    """Launcher side: rank -> the unpickled dump, for the ranks that answered in time (within
    `seconds`, or before `wait` gave up)."""
    pids = dict.fromkeys(ranks, 0)  # asked by a request file: no pid needed
    return asking.collect(asking.FLIGHT_DUMP, state_dir, pids, wait, seconds, _unpickle)


def _unpickle(data: bytes) -> Dump:
    found = pickle.loads(data)  # noqa: S301 - written by our own ranks
    if not isinstance(found, dict):
        raise ValueError("not a flight-recorder dump")
    return found


@dataclass(frozen=True)
class Flight:
    """What one rank's dump says, read once: the oldest collective not completed ('nccl:all_reduce
    #6 (scheduled)'), that one's op, sequence number and input shapes, and its last few lines."""

    pending: str | None
    op: str = ""
    seq: int | None = None
    shapes: str = ""
    lines: tuple[str, ...] = ()


def read(dump: Dump) -> Flight:
    entry = pending_entry(dump)
    if entry is None:
        return Flight(None, lines=tuple(summarize(dump)))
    seq = int(entry.get("collective_seq_id", -1))
    sizes = entry.get("input_sizes")
    return Flight(
        pending(dump),
        op_of(entry),
        seq if seq >= 0 else None,
        " ".join(str(list(x)) for x in sizes) if sizes else "",
        tuple(summarize(dump)),
    )


def op_of(entry: Dump) -> str:
    """'all_reduce' of an entry (its profiling name without the backend)."""
    return _op(entry)


def pending_entry(dump: Dump) -> Dump | None:
    """The oldest collective this rank issued that has not completed, as its dump entry."""
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    status = dump.get("pg_status") or {} if isinstance(dump, dict) else {}
    return next((e for e in entries if not _completed(e, status)), None)


def _op(entry: Dump) -> str:
    name = str(entry.get("profiling_name", "?"))
    return name.split(":", 1)[1] if ":" in name else name  # "nccl:all_reduce", "gloo:..."


def _completed(entry: Dump, status: Dump) -> bool:
    """Whether a recorded collective has finished. gloo leaves every entry "scheduled" and
    keeps the truth in the process groups' status; NCCL updates the entries."""
    if entry.get("state") == "completed":  # NCCL marks its entries
        return True
    group = entry.get("process_group")
    seqs = status.get(str(group[0] if isinstance(group, list | tuple) else group))
    return seqs is not None and int(entry.get("collective_seq_id", -1)) <= int(
        seqs.get("last_completed_collective", -1)
    )


def summarize(dump: Dump, last: int = 3) -> list[str]:
    """A few lines from one rank's dump: its last collectives, newest last."""
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    status = dump.get("pg_status") or {} if isinstance(dump, dict) else {}
    lines = []
    for e in entries[-last:]:
        state = "completed" if _completed(e, status) else e.get("state", "?")
        lines.append(
            f"#{e.get('collective_seq_id', '?')} {_op(e)} {state} in={e.get('input_sizes', '?')}"
        )
    return lines


def ask(state_dir: Path, rank: int) -> None:
    """Request the process groups' status without waiting (the hang watch reads it at its
    next sample)."""
    asking.ask(asking.FLIGHT_STATUS, state_dir, {rank: 0})


def answer(state_dir: Path, rank: int) -> Dump | None:
    """The dump a rank wrote after `ask`, or None if it has not (yet)."""
    data = asking.answer(asking.FLIGHT_STATUS, state_dir, rank)
    try:
        return _unpickle(data) if data is not None else None
    except Exception:
        return None


def progress_state(dump: Dump) -> tuple[int, object]:
    """(completed collectives, what is pending or None): the completed count grows while the
    rank makes progress; the same pending value at two polls means it waits there. From the
    process groups' status when the dump has it, else from its entries."""
    status = dump.get("pg_status") if isinstance(dump, dict) else None
    if status:
        completed, waiting = 0, []
        for group, seqs in sorted(status.items(), key=lambda kv: str(kv[0])):
            done = int(seqs.get("last_completed_collective", -1))
            completed += max(done, 0)
            if int(seqs.get("last_enqueued_collective", -1)) > done:
                waiting.append((str(group), done + 1))
        return completed, tuple(waiting) or None
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    ended = [int(e.get("collective_seq_id", -1)) for e in entries if e.get("state") == "completed"]
    unfinished = [
        int(e.get("collective_seq_id", -1)) for e in entries if e.get("state") != "completed"
    ]
    return max(ended, default=-1), min(unfinished, default=None)


def pending(dump: Dump) -> str | None:
    """The oldest collective this rank issued that has not completed, if any, with its backend:
    'nccl:all_reduce #6 (scheduled)'."""
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    status = dump.get("pg_status") or {} if isinstance(dump, dict) else {}
    for e in entries:
        if not _completed(e, status):
            name = str(e.get("profiling_name", "?"))
            return f"{name} #{e.get('collective_seq_id', '?')} ({e.get('state')})"
    return None
