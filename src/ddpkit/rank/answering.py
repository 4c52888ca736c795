"""The rank's side of the launcher's questions (ddpkit.launch.base.asking): one thread answers them.

`answer(state_dir, rank, request, answer, make)` registers a question asked by a request file:
when the launcher drops `rank<N>.<request>`, the thread removes it, calls `make()` and writes
what it returns to `rank<N>.<answer>` atomically (a reader never sees half an answer). The
thread starts with the first question and polls every POLL s; a question whose `make` fails is
left unanswered (the launcher's deadline covers it). Questions asked by a signal (the stacks)
are answered by C code (faulthandler) and need no thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.rank import runtime

POLL = 0.2  # seconds between looks for requests


@dataclass
class Answering:
    """The questions this rank answers and the thread that answers them: a part of its
    runtime (ddpkit.rank.runtime); closing it ends the thread at its next look."""

    questions: list[tuple[Path, Path, Callable[[], bytes]]] = field(default_factory=list)
    first: list[Callable[[], object]] = field(default_factory=list)  # set-up, run first
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.closed.set()


def answer(
    state_dir: str | Path,
    rank: int | str,
    request: str,
    answer: str,
    make: Callable[[], bytes],
    first: Callable[[], object] | None = None,
) -> None:
    """Answer the launcher's `request` with `make()`'s bytes in the file `answer`; `first`:
    set-up the thread runs before it answers (off the script's thread)."""
    answering = runtime.current().part(Answering)
    request_path = protocol.state_path(state_dir, rank, request)
    answer_path = protocol.state_path(state_dir, rank, answer)
    with answering.lock:
        answering.questions.append((request_path, answer_path, make))
        if first is not None:
            answering.first.append(first)
        if answering.thread is None:
            answering.thread = threading.Thread(
                target=_loop, args=(answering,), daemon=True, name="ddpkit-answers"
            )
            answering.thread.start()


def _loop(answering: Answering) -> None:
    while not answering.closed.is_set():
        with answering.lock:
            setup, answering.first[:] = list(answering.first), []
        for fn in setup:
            with contextlib.suppress(Exception):
                fn()
        if answering.closed.wait(POLL):
            return
        with answering.lock:
            questions = list(answering.questions)
        for request, out, make in questions:
            if not request.exists():
                continue
            with contextlib.suppress(Exception):
                request.unlink()
                _write_atomic(out, make())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
