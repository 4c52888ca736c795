"""Worker output: one ordered stream per rank, to its log and to the console.

Each worker writes stdout and stderr into one pipe, so what it printed arrives in the order it
printed it; Python-level stderr is framed (`ddpkit.common.protocol.ERR_START`/`ERR_END`,
written by the rank's bootstrap) so the launcher can still send it to its own stderr. Writes to file
descriptor 2 from C code or from subprocesses arrive unframed, in order, with stdout.

Every byte goes to the rank's log, as the rank wrote it. The console gets each line with a
`[rank N]` prefix (for the ranks asked for), and behaves as a terminal would for a progress bar:
a carriage return redraws the line with its prefix once, a line printed after a cleared bar
takes its place, and nothing stray is left at exit. Partial lines (a `(Pdb) ` prompt) are shown
at once. Data moves in large chunks, so a chatty rank is not slowed down, and a line without a
newline costs linear time and bounded memory.

A console that stops taking output (its reader closed the pipe, `| head`) marks
`Console.closed`; the supervisor then stops the job. A log that cannot be written (a full disk)
stops being written, with one warning, and the console goes on (docs/launcher.md, "Output").
"""

from __future__ import annotations

import os
import re
import select
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

from ddpkit.common.protocol import ERR_END, ERR_START, LOG_END, LOG_ONLY, LOG_START
from ddpkit.launch.base.rundir import open_private

TAIL_LINES = 30
TAIL_LINE_BYTES = 4096  # the report keeps at most this much of one line
CHUNK = 1 << 16
HOLD_MS = 100  # a partial line (a prompt) is shown after this long without more output
DRAIN_IDLE = 2.0  # at close: stop reading once the pipe gave nothing for this long
BAR_EVERY = 5.0  # seconds between the states of a progress bar written to a log


@dataclass
class Bar:
    """A line a rank keeps redrawing with carriage returns (a progress bar), in a log."""

    text: bytes = b""  # its latest state
    written: bool = False  # that state is in the log already
    shown_at: float = 0.0  # when a state of it was last written (0: never)


class Console:
    """The launcher's stdout and stderr, shared by every rank, with the state of the line
    the cursor is on (a terminal has one line, whichever stream wrote it).

    On a terminal a carriage return redraws the line. Where the stream is not a terminal (a
    file, a pipe, a SLURM job's output), a redrawn line (a progress bar) is written as whole
    lines instead: its first state, then a state every BAR_EVERY seconds, then its last one,
    each line prefixed once; blank redraws (a bar erased) write nothing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed: str | None = None  # why the console stopped taking output
        self.owner: int | None = None  # the rank whose line is open (no newline yet)
        self.bare = False  # the open line holds only its prefix (after a carriage return)
        self.bars: dict[tuple[int, int], Bar] = {}  # (rank, stream) -> its bar, in a log
        self.prompt = b""  # a prompt shown and waiting for its answer (the cursor is after it)
        self._tty: dict[int, bool] = {}

    def is_terminal(self, stream: int) -> bool:
        if stream not in self._tty:
            try:
                self._tty[stream] = (sys.stderr if stream == 2 else sys.stdout).isatty()
            except (AttributeError, ValueError):
                self._tty[stream] = False
        return self._tty[stream]

    def write(self, rank: int, prefix: bytes, stream: int, data: bytes) -> None:
        out = _buffer(sys.stderr if stream == 2 else sys.stdout)
        if out is None or self.closed:
            return
        with self.lock:
            self.prompt = b""  # the rank wrote on: the answer was given
            try:
                if prefix and b"\r" in data and not self.is_terminal(stream):
                    out.write(self._shape_log(rank, prefix, stream, data))
                else:
                    out.write(self._shape(rank, prefix, data))
                out.flush()
            except (BrokenPipeError, ValueError):
                self.closed = "the console's output was closed (a pipe that stopped reading?)"
            except OSError as err:
                self.closed = f"the console's output failed: {err.strerror}"

    def _shape(self, rank: int, prefix: bytes, data: bytes) -> bytes:
        """`data` with the prefix at the start of each line, as a terminal should show it."""
        if not prefix:
            return data
        out = bytearray()
        if self.owner is not None and self.owner != rank:
            out += b"\n"  # another rank's line is open: start a line of our own
            self.owner, self.bare = None, False
        if b"\r" not in data:  # the fast path: whole lines, one pass
            if self.owner is None:
                out += prefix
            out += data.replace(b"\n", b"\n" + prefix)
            if data.endswith(b"\n"):
                del out[-len(prefix) :]  # the next line's prefix comes with it
                self.owner, self.bare = None, False
            else:
                self.owner, self.bare = rank, False
            return bytes(out)
        parts = [bytes(out)]
        for piece in _pieces(data):  # the slow path, for progress bars
            if piece.startswith(b"\r"):
                parts.append(b"\r" + prefix + piece[1:])
                self.bare = len(piece) == 1
            else:
                parts.append(piece if self.owner == rank else prefix + piece)
                self.bare = False
            self.owner = None if piece.endswith(b"\n") else rank
        return b"".join(parts)

    def _shape_log(self, rank: int, prefix: bytes, stream: int, data: bytes) -> bytes:
        """`data` for a log: whole prefixed lines, a redrawn line now and then (class doc)."""
        out = bytearray()
        bar = self.bars.get((rank, stream))
        for piece in _pieces(data):
            if not piece.startswith(b"\r"):
                if bar is not None:  # a line printed while a bar was drawn: the bar first
                    out += self._bar_line(prefix, bar, final=True)
                    self.bars.pop((rank, stream), None)
                    bar = None
                out += self._shape(rank, prefix, piece)
                continue
            if self.owner is not None:  # an open partial line ends where a redraw begins
                out += b"\n"
                self.owner, self.bare = None, False
            text = piece[1:].rstrip(b"\n").rstrip()  # tqdm pads a shorter state with spaces
            ended = piece.endswith(b"\n")
            if not text:  # the bar erased (or a bare \r\n): its last state stays in the log
                if bar is not None:
                    out += self._bar_line(prefix, bar, final=True)
                    self.bars.pop((rank, stream), None)
                    bar = None
                continue
            if bar is None:
                bar = self.bars[(rank, stream)] = Bar()
            bar.text, bar.written = text, False
            if ended:
                out += self._bar_line(prefix, bar, final=True)
                self.bars.pop((rank, stream), None)
                bar = None
            elif not bar.shown_at or time.monotonic() - bar.shown_at >= BAR_EVERY:
                out += self._bar_line(prefix, bar, final=False)
        return bytes(out)

    @staticmethod
    def _bar_line(prefix: bytes, bar: Bar, final: bool) -> bytes:
        """The bar's state as a line, unless that state is in the log already."""
        if bar.written or not bar.text:
            return b""
        bar.written, bar.shown_at = True, time.monotonic()
        return prefix + bar.text + b"\n"

    def say(self, text: str) -> None:
        """A line of the launcher's own on stderr, on a line of its own: a rank's open line
        (a prompt waiting for its answer) is ended first."""
        out = _buffer(sys.stderr)
        if out is None:
            return
        with self.lock:
            try:
                if (self.owner is not None or self.prompt) and not self.closed:
                    out.write(b"\n")
                    self.owner, self.bare = None, False
                out.write(text.encode(errors="replace") + b"\n")
                if self.prompt and not self.closed:  # where the answer is typed, again
                    out.write(self.prompt)
                out.flush()
            except (OSError, ValueError):
                pass  # stderr is gone too: the exit code and report.txt still tell

    def line_ended(self, rank: int, prompt: bytes = b"") -> None:
        """The terminal ends the rank's open line itself (the echo of a typed answer); until it
        does, the cursor stands after `prompt`, which a line of the launcher's shows again."""
        with self.lock:
            if self.owner == rank:
                self.owner, self.bare = None, False
                self.prompt = prompt

    def end_line(self, rank: int) -> None:
        """At a rank's end: close its open line (erase a lone prefix on a terminal); in a log,
        write the last state of a bar it left drawn."""
        with self.lock:
            for stream in (1, 2):
                bar = self.bars.pop((rank, stream), None)
                out = _buffer(sys.stderr if stream == 2 else sys.stdout)
                if bar is not None and out is not None and not self.closed:
                    try:
                        out.write(self._bar_line(b"[rank %d] " % rank, bar, final=True))
                        out.flush()
                    except (OSError, ValueError):
                        self.closed = "the console's output was closed"
            if self.owner != rank or self.closed:
                return
            out = _buffer(sys.stdout)
            tty = sys.stdout.isatty()
            tail = b"\r\x1b[K" if self.bare and tty else b"\n"
            self.owner, self.bare = None, False
            try:
                if out is not None:
                    out.write(tail)
                    out.flush()
            except (OSError, ValueError):
                self.closed = "the console's output was closed"


_TRACE_POINT = re.compile(rb"^USDT:[^\n]*(\n|$)", re.M)


def _pieces(data: bytes) -> list[bytes]:
    """Split after each newline and before each carriage return."""
    pieces, start = [], 0
    for i, byte in enumerate(data):
        if byte == 0x0D and i > start:  # "\r"
            pieces.append(data[start:i])
            start = i
        elif byte == 0x0A:  # "\n"
            pieces.append(data[start : i + 1])
            start = i + 1
    if start < len(data):
        pieces.append(data[start:])
    return pieces


def _buffer(stream: object) -> BinaryIO | None:
    """The stream's bytes side; for a text stream that has none (a notebook's cell output:
    ipykernel's OutStream), the text written through it."""
    buffer = getattr(stream, "buffer", None)
    if buffer is None and hasattr(stream, "write"):
        return cast(BinaryIO, _TextSink(stream))
    return buffer


class _TextSink:
    """Bytes written as text to a stream with no bytes side."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, data: bytes) -> int:
        self.stream.write(data.decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        self.stream.flush()


CONSOLE = Console()


class RankOutput:
    """Pumps one rank's pipe into its log and the console (one thread)."""

    def __init__(
        self,
        rank: int,
        log_path: str,
        shown: frozenset[int] = frozenset({1, 2}),
        prefix: bool = True,
        console: Console = CONSOLE,
        reads_stdin: bool = False,
    ) -> None:
        self.rank = rank
        self.prefix = f"[rank {rank}] ".encode() if prefix else b""
        self.shown = shown  # the streams that reach the console (1 stdout, 2 stderr)
        self.reads_stdin = reads_stdin  # this rank reads the terminal (input(), pdb)
        self.console = console
        self.log_path = log_path
        fd = open_private(Path(log_path))
        self.log: BinaryIO | None = open(fd, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self.log_error: str | None = None
        self.tail: deque[bytes] = deque(maxlen=TAIL_LINES)  # the last lines, both streams
        self._line = b""  # the unfinished last line, for the tail (bounded)
        self._torch_prefix = f"[rank{rank}]: ".encode()
        self.thread: threading.Thread | None = None
        self._stream = 1
        self._split = b""  # a marker's first bytes, split across two reads
        self._held: tuple[int, bytes] | None = None  # an unfinished line, not yet shown
        self.read_last = time.monotonic()

    @property
    def last_lines(self) -> list[str]:
        """The rank's last lines (both streams, torch's own `[rankN]:` prefix removed)."""
        return [
            line.replace(self._torch_prefix, b"").decode(errors="replace").rstrip("\r")
            for line in self.tail
        ]

    def start(self, pipe: IO[bytes]) -> None:
        self.thread = threading.Thread(
            target=self._pump, args=(pipe,), daemon=True, name=f"rank{self.rank}-output"
        )
        self.thread.start()

    def _pump(self, pipe: IO[bytes]) -> None:
        fd = pipe.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        while True:
            if self._held and not poller.poll(HOLD_MS):
                prompt = self._held[1]
                self._show_held()  # quiet for a moment: show the partial line (a prompt)
                if self.reads_stdin:  # the user answers it and presses Enter: a new line
                    self.console.line_ended(self.rank, self.prefix + prompt)
                continue
            try:
                chunk = os.read(fd, CHUNK)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.read_last = time.monotonic()
            for stream, data in self._frames(chunk):
                self._take(stream, data)
        if self._split:
            self._take(self._stream, self._split)
        self._show_held()
        if self.shown:
            self.console.end_line(self.rank)
        pipe.close()

    def _frames(self, chunk: bytes) -> list[tuple[int, bytes]]:
        """(stream, bytes) runs of a chunk: stderr between the bootstrap's ERR markers, what is
        for the log only between its LOG markers."""
        if not self._split and b"\x1e" not in chunk:  # no marker, not even part of one
            return [(self._stream, chunk)]
        data, self._split = self._split + chunk, b""
        runs = []
        while data:
            if self._stream == 1:
                found = [(i, m) for m in (ERR_START, LOG_START) if (i := data.find(m)) >= 0]
                at, marker = min(found) if found else (-1, ERR_START)
            else:
                marker = ERR_END if self._stream == 2 else LOG_END
                at = data.find(marker)
            if at < 0:
                keep = max(_partial_marker(data, m) for m in _ENDS.get(self._stream, (marker,)))
                if len(data) > keep:
                    runs.append((self._stream, data[: len(data) - keep]))
                self._split = data[len(data) - keep :]
                break
            if at:
                runs.append((self._stream, data[:at]))
            self._stream = _NEXT[marker]
            data = data[at + len(marker) :]
        return runs

    def _take(self, stream: int, data: bytes) -> None:
        if self.log is not None:
            try:
                self.log.write(data)
            except OSError as err:
                self._log_failed(err)
        if stream == LOG_ONLY:
            return
        self._keep_tail(data)
        if stream not in self.shown:
            return
        if self._held and self._held[0] != stream:
            self._show_held()
        data = (self._held[1] if self._held else b"") + data
        # lines go to the console whole (another rank's output never splits one); the
        # unfinished rest waits for its end, or HOLD_MS of quiet, or CHUNK bytes
        cut = max(data.rfind(b"\n"), data.rfind(b"\r") - 1) + 1
        if len(data) - cut >= CHUNK:
            cut = len(data)
        self._held = (stream, data[cut:]) if cut < len(data) else None
        if cut:
            self._show(stream, data[:cut])

    def _show(self, stream: int, data: bytes) -> None:
        shown = data.replace(self._torch_prefix, b"") if self.prefix else data
        if b"USDT:" in shown:  # kineto's trace points (profiler_start): for the log only
            shown = _TRACE_POINT.sub(b"", shown)
            if not shown:
                return
        self.console.write(self.rank, self.prefix, stream, shown)

    def _show_held(self) -> None:
        if self._held:
            stream, data = self._held
            self._held = None
            self._show(stream, data)

    def _log_failed(self, err: OSError) -> None:
        self.log_error = f"{self.log_path}: {err.strerror or err}"
        log, self.log = self.log, None
        try:
            log.close()  # type: ignore[union-attr]
        except OSError:
            pass
        print(
            f"ddpkit: warning: rank {self.rank}'s log cannot be written ({self.log_error}); "
            "it stops here, the console goes on",
            file=sys.stderr,
            flush=True,
        )

    def _keep_tail(self, data: bytes) -> None:
        # only the end can be in the tail: look at the last TAIL_LINES lines, no further
        start = len(data)
        for _ in range(TAIL_LINES + 1):
            start = data.rfind(b"\n", 0, start)
            if start < 0:
                break
        if start > 0:
            self._line, data = b"", data[start + 1 :]
        lines = data.split(b"\n")
        lines[0] = self._line + lines[0]
        for line in lines[:-1]:
            self.tail.append(line[-TAIL_LINE_BYTES:])
        self._line = lines[-1][-TAIL_LINE_BYTES:]

    def close(self) -> None:
        """Read to the end (the rank has exited), then close the log. A pipe still held open
        by something the rank left behind is given up once it stays quiet for DRAIN_IDLE s."""
        if self.thread is not None:
            while self.thread.is_alive():
                self.thread.join(0.1)
                if time.monotonic() - self.read_last > DRAIN_IDLE:
                    break
        if self._line:
            self.tail.append(self._line)
            self._line = b""
        if self.log is not None:
            try:
                self.log.close()
            except OSError as err:
                self.log_error = f"{self.log_path}: {err.strerror or err}"
            self.log = None


_NEXT = {ERR_START: 2, ERR_END: 1, LOG_START: LOG_ONLY, LOG_END: 1}
_ENDS = {1: (ERR_START, LOG_START)}  # the markers a run of stdout can end in


def _partial_marker(data: bytes, marker: bytes) -> int:
    """How many bytes at the end of `data` could be the start of `marker`."""
    for keep in range(min(len(marker) - 1, len(data)), 0, -1):
        if marker.startswith(data[-keep:]):
            return keep
    return 0
