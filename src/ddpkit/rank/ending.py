"""How a rank ends: its exit code said to the launcher, its atexit work done, its files
flushed, without the interpreter's teardown; and its traceback as `python script.py` would show
it, without ddpkit's own frames."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from types import TracebackType

from ddpkit.common import protocol
from ddpkit.rank import runtime


def exit_quickly(code: object) -> None:
    """End the worker as the interpreter would, minus its final teardown.

    Non-daemon threads are joined, atexit handlers run (ddpkit's close, logging, temp dirs,
    multiprocessing), every open file is flushed, then the process exits without tearing down
    the interpreter. That teardown is where PyTorch's gloo threads can abort the process
    (SIGABRT, "terminate called without an active exception") after the script succeeded;
    DDPKIT_CLEAN_EXIT=0 keeps the ordinary exit.
    """
    if os.environ.get("DDPKIT_CLEAN_EXIT", "1") == "0":
        sys.exit(code)  # type: ignore[arg-type]
    import atexit
    import gc
    import io
    import threading

    status = code if isinstance(code, int) else (0 if code is None else 1)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    here = runtime.current()
    if here.state_dir:
        with contextlib.suppress(OSError):  # when it ended, for the launcher's root cause
            protocol.write_ended(here.state_dir, here.rank_name, status)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    try:
        objects = gc.get_objects()
    except MemoryError:  # out of memory at the end: the standard streams are still flushed
        objects = []
    for obj in objects:
        # type(), not isinstance(): never touch attributes of arbitrary objects
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


_RANK_SIDE = os.path.dirname(os.path.abspath(__file__))  # ddpkit/rank: the bootstrap, its hooks


def _ours(tb: TracebackType) -> bool:
    name = tb.tb_frame.f_code.co_filename
    return (
        name == runpy.__file__
        or name.startswith("<frozen runpy")
        or os.path.dirname(os.path.abspath(name)) == _RANK_SIDE
    )


def user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without ddpkit's own frames (the bootstrap, runpy, the wrappers that
    record collectives and time steps): what `python script.py` would have shown."""
    while tb is not None and _ours(tb):
        tb = tb.tb_next
    head = tb
    while tb is not None:
        following = tb.tb_next
        while following is not None and _ours(following):
            following = following.tb_next
        tb.tb_next = following
        tb = following
    return head
