"""Worker output: every byte to the rank's log file, lines to the console with a `[rank N]`
prefix (for the ranks the user asked to see), and the last lines of stderr kept for the report.

A progress bar's carriage returns end a segment too, so tqdm bars redraw in place instead of
arriving as one line at the end.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from typing import BinaryIO

TAIL_LINES = 30


class RankOutput:
    """Pumps one rank's stdout and stderr (one thread each) into its log and the console."""

    def __init__(self, rank: int, log_path: str, show: bool, prefix: bool = True) -> None:
        self.rank = rank
        self.prefix = f"[rank {rank}] ".encode() if prefix else b""
        self.show = show
        self.log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, stdout: BinaryIO, stderr: BinaryIO) -> None:
        for pipe, console, keep in ((stdout, sys.stdout, False), (stderr, sys.stderr, True)):
            t = threading.Thread(
                target=self._pump,
                args=(pipe, console, keep),
                daemon=True,
                name=f"rank{self.rank}-output",
            )
            t.start()
            self.threads.append(t)

    def _pump(self, pipe: BinaryIO, console: object, keep: bool) -> None:
        fd = pipe.fileno()
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            while True:
                # a segment ends after "\n", or just before a "\r" that starts a redraw
                nl, cr = pending.find(b"\n"), pending.find(b"\r", 1)
                if nl < 0 and cr < 0:
                    break
                cut = nl + 1 if cr < 0 or 0 <= nl < cr else cr
                self._emit(pending[:cut], console, keep)
                pending = pending[cut:]
        if pending:
            self._emit(pending + b"\n", console, keep)
        pipe.close()

    def _emit(self, segment: bytes, console: object, keep: bool) -> None:
        with self._lock:
            self.log.write(segment)
        if keep and segment.endswith(b"\n"):
            self.stderr_tail.append(segment.decode(errors="replace").rstrip("\n"))
        if self.show:
            out = console.buffer if hasattr(console, "buffer") else None  # type: ignore[attr-defined]
            if out is not None:
                line = (
                    b"\r" + self.prefix + segment[1:]
                    if segment.startswith(b"\r")
                    else self.prefix + segment
                )
                with _console_lock:
                    out.write(line)
                    out.flush()

    def close(self, timeout: float = 2.0) -> None:
        for t in self.threads:
            t.join(timeout)
        self.log.close()


_console_lock = threading.Lock()
