"""Ask ranks for a file and read their answers, with a deadline: one way for every request.

A `Question` says how a rank is asked and where it answers:

    by a request file   the launcher drops `rank<N>.<request>` (and removes the old answer);
                        the rank's answering thread (ddpkit.rank.answering) writes
                        `rank<N>.<answer>` atomically (flight-recorder dumps and status)
    by a signal         the launcher signals the rank's process; C code in the rank appends
                        to `rank<N>.<answer>` even while Python cannot run (faulthandler's
                        stacks)

`ask` asks without waiting (the hang watch reads the status at its next sample, `answer`);
`collect` asks and reads what came within `seconds`, or until the `Wait` gives up on a stop
signal. Nothing else in the launcher writes requests or reads answers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ddpkit.common import protocol
from ddpkit.launch.base.wait import Wait

T = TypeVar("T")


@dataclass(frozen=True)
class Question:
    answer: str  # the answer's file name (protocol)
    request: str | None = None  # the request's file name; None: asked by `signal`
    signal: int | None = None

    def paths(self, state_dir: Path, rank: int) -> tuple[Path | None, Path]:
        request = protocol.state_path(state_dir, rank, self.request) if self.request else None
        return request, protocol.state_path(state_dir, rank, self.answer)


FLIGHT_DUMP = Question(protocol.FLIGHT_DUMP, protocol.FLIGHT_REQUEST)
FLIGHT_STATUS = Question(protocol.FLIGHT_STATUS_DUMP, protocol.FLIGHT_STATUS_REQUEST)
STACKS = Question(protocol.STACKS, signal=protocol.STACKS_SIGNAL)


def ask(question: Question, state_dir: Path, pids: dict[int, int]) -> dict[int, int]:
    """Ask each rank (rank -> pid); rank -> the answer file's size before the question (an
    answer by signal is what is appended past it)."""
    sizes = {}
    for rank, pid in pids.items():
        request, out = question.paths(state_dir, rank)
        if request is None:
            sizes[rank] = out.stat().st_size if out.exists() else 0
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, question.signal or 0)
        else:
            sizes[rank] = 0
            out.unlink(missing_ok=True)
            request.touch()
    return sizes


def answer(question: Question, state_dir: Path, rank: int, since: int = 0) -> bytes | None:
    """The rank's answer (what was appended past `since`), or None while it has not come."""
    out = question.paths(state_dir, rank)[1]
    try:
        if out.stat().st_size <= since:
            return None
        if question.request is None:
            time.sleep(0.1)  # faulthandler writes in pieces: let it finish
        with out.open("rb") as f:
            f.seek(since)
            return f.read()
    except OSError:
        return None


def collect(
    question: Question,
    state_dir: Path,
    pids: dict[int, int],
    wait: Wait,
    seconds: float,
    parse: Callable[[bytes], T],
) -> dict[int, T]:
    """Ask every rank and read the answers that came within `seconds` (or before `wait` gave
    up): rank -> `parse(answer)`; an answer `parse` cannot read is left out."""
    sizes = ask(question, state_dir, pids)
    answers: dict[int, T] = {}
    tried: set[int] = set()

    def arrived() -> bool:
        for rank in pids:
            if rank in tried:
                continue
            data = answer(question, state_dir, rank, sizes[rank])
            if data is not None:
                tried.add(rank)
                with contextlib.suppress(Exception):
                    answers[rank] = parse(data)
        return len(tried) == len(pids)

    wait.until(arrived, seconds, poll=0.1)
    return answers
