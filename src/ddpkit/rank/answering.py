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
import time
from collections.abc import Callable
from pathlib import Path

from ddpkit.common import protocol

POLL = 0.2  # seconds between looks for requests

_questions: list[tuple[Path, Path, Callable[[], bytes]]] = []
_first: list[Callable[[], object]] = []  # set-up the thread runs before it answers
_lock = threading.Lock()
_thread: threading.Thread | None = None


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
    global _thread
    request_path = protocol.state_path(state_dir, rank, request)
    answer_path = protocol.state_path(state_dir, rank, answer)
    with _lock:
        _questions.append((request_path, answer_path, make))
        if first is not None:
            _first.append(first)
        if _thread is None:
            _thread = threading.Thread(target=_loop, daemon=True, name="ddpkit-answers")
            _thread.start()


def _loop() -> None:
    while True:
        with _lock:
            setup, _first[:] = list(_first), []
        for fn in setup:
            with contextlib.suppress(Exception):
                fn()
        time.sleep(POLL)
        with _lock:
            questions = list(_questions)
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
