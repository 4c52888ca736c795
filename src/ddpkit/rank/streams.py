"""The rank's output into the launcher's one pipe: stdout buffered and flushed by a thread,
stderr framed (protocol.ERR_START/ERR_END) so the launcher tells the two apart in the order the
rank wrote them."""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from typing import Any

from ddpkit.common import protocol

FLUSH_EVERY = 0.05  # seconds: the most a printed line waits in the rank's stdout buffer


def buffer_stdout() -> None:
    """Python's stdout into the launcher's pipe: a 64 KiB buffer that a thread flushes every
    FLUSH_EVERY s (and stderr writes flush first). A chatty rank then writes in large blocks
    instead of one system call per line, and a line still shows within 50 ms. Not done when
    the user set PYTHONUNBUFFERED, which keeps Python's own meaning."""
    if os.environ.get("PYTHONUNBUFFERED"):
        return
    old = sys.stdout
    raw = io.FileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(raw, 1 << 16),
        encoding=getattr(old, "encoding", None) or "utf-8",
        errors=getattr(old, "errors", None) or "strict",
    )

    def flush_now_and_then() -> None:
        while True:
            time.sleep(FLUSH_EVERY)
            try:
                sys.stdout.flush()
            except Exception:  # a closed or replaced stdout: the script's business
                pass

    threading.Thread(target=flush_now_and_then, daemon=True, name="ddpkit-flush").start()


class _FramedStderr(io.RawIOBase):
    """fd 2 (the pipe stdout shares), with each write framed as stderr for the launcher."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2

    def write(self, data: Any) -> int:
        try:
            sys.stdout.flush()  # what was printed before comes first
        except Exception:
            pass
        view = protocol.ERR_START + bytes(data) + protocol.ERR_END
        while view:
            try:
                view = view[os.write(2, view) :]
            except InterruptedError:
                continue
        return len(data)


def frame_stderr() -> None:
    """Python's stderr goes into the one ordered stream, marked as stderr."""
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    sys.stderr = io.TextIOWrapper(
        _FramedStderr(),
        encoding=encoding,
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
