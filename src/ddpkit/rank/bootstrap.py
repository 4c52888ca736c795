"""The first code a worker runs: ties the worker to the launcher, then runs the user's script.

`python -m ddpkit.rank.bootstrap script|module|command TARGET [ARGS...]`

Before the user's code: the kernel is asked to SIGKILL this process when the launcher dies
(PR_SET_PDEATHSIG), faulthandler dumps every thread's stack to the rank's stack file on
protocol.STACKS_SIGNAL
(works while blocked in C code), and init_process_group is watched so the launcher can tell which
ranks reached init. An uncaught exception is written, with its time, to the rank's error file so
the launcher can tell the root cause from the ranks that failed because of it. The user's script
then runs as `__main__`, as `python script.py` would run it.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import faulthandler
import importlib.abc
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import types
import zipfile
from types import ModuleType, TracebackType
from typing import Any

from ddpkit.common import protocol

PR_SET_PDEATHSIG = 1
STATE_DIR = os.environ.get(protocol.STATE_DIR, "")
RANK = os.environ.get("RANK", "0")


def set_phase(phase: str) -> None:
    """Record this rank's phase (started / init / ready) for the launcher."""
    from ddpkit.rank.progress import set_phase as tell

    tell(phase)


def tie_to_launcher() -> None:
    """SIGKILL this process when the launcher dies, even by SIGKILL (Linux only)."""
    launcher = int(os.environ.get(protocol.LAUNCHER_PID, "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if launcher and os.getppid() != launcher:  # the launcher died before prctl took effect
        os._exit(128 + signal.SIGKILL)


class _ImportWatcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs a function on some of torch's modules right after they are imported (by the
    script, or by `import torch` itself), to watch init and time steps. No torch import is
    triggered by this."""

    def __init__(self) -> None:
        from ddpkit.rank import init_watch, sampler_watch, steps

        self.targets = {
            "torch.distributed.distributed_c10d": init_watch.patch_init,
            "torch.utils.data.distributed": sampler_watch.patch_sampler,
            "torch.autograd": steps.patch_backward,
            "torch.optim.optimizer": steps.install_optimizer_hooks,
            "torch.utils.data.dataloader": steps.patch_dataloader,
        }

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        after = self.targets.pop(name, None)
        if after is None:
            return None
        if not self.targets:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner, then = spec.loader, after

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> ModuleType | None:
                return inner.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                inner.exec_module(module)
                try:
                    then(module)
                except Exception as err:  # never break the script's import of torch
                    from ddpkit.errors import debug_note

                    debug_note(f"watching {module.__name__}", err)

        spec.loader = Loader()
        return spec


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


def dump_stacks_on_signal() -> None:
    """Stacks on the launcher's request, and on a fatal signal (SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE, SIGILL) into the rank's fault file, so the report names the line it died at."""
    if not STATE_DIR:
        return
    stacks = open(protocol.state_path(STATE_DIR, RANK, protocol.STACKS), "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(protocol.STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    if not faulthandler.is_enabled():  # `python -X faulthandler`'s choice is the user's
        fault = open(protocol.state_path(STATE_DIR, RANK, protocol.FAULT), "w")  # noqa: SIM115 - open for the process's life
        faulthandler.enable(file=fault, all_threads=True)


def main(argv: list[str]) -> None:
    kind, target, *args = argv
    tie_to_launcher()
    store_fd = os.environ.get(protocol.STORE_FD)
    if store_fd:  # the rank's own children (loader workers, subprocesses) never get it
        with contextlib.suppress(OSError, ValueError):
            os.set_inheritable(int(store_fd), False)
    os.environ[protocol.RANK_PID] = str(os.getpid())  # children inherit it: "not the rank"
    set_phase("started")
    if kind == "command":
        os.execvp(target, [target, *args])  # noqa: S606 - death signal survives exec
    from ddpkit.rank import init_args, memory

    init_args.remember_launcher()  # before the script can change them
    memory.reserve()
    if os.environ.get(protocol.FRAMED) == "1":
        buffer_stdout()
        frame_stderr()
    dump_stacks_on_signal()
    from ddpkit.rank import progress

    progress.start_ticking()
    sys.meta_path.insert(0, _ImportWatcher())
    from ddpkit.errors import install_excepthook

    install_excepthook()
    from ddpkit.rank import failure

    failure.record_errors()
    sys.argv = [target, *args]
    try:
        if kind == "module":
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            run_script(target)
    except SystemExit as done:
        if done.code not in (None, 0):
            code = done.code if isinstance(done.code, int) else 1
            from ddpkit.rank.failure import write_error

            write_error("SystemExit", f"sys.exit({done.code!r})", exit_code=code)
            sys.last_value = done  # ddpkit's close sees a failure: no barrier with the peers
        exit_quickly(done.code)
    except KeyboardInterrupt as interrupt:
        # as `python script.py` ends on Ctrl+C (the traceback, then death by SIGINT), minus
        # the frames of ddpkit's own
        trimmed = _user_frames(interrupt.__traceback__)
        traceback.print_exception(type(interrupt), interrupt.with_traceback(trimmed), trimmed)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException as err:
        # Report it as `python script.py` would: without this file's and runpy's frames.
        trimmed = _user_frames(err.__traceback__)
        sys.last_type, sys.last_value, sys.last_traceback = type(err), err, trimmed
        sys.excepthook(type(err), err.with_traceback(trimmed), trimmed)
        exit_quickly(1)
    exit_quickly(0)


def run_script(target: str) -> None:
    """Run a script as `python script.py` does: sys.argv[0] as given, __file__ and sys.path[0]
    absolute, the script's own module as __main__ (so pickling and multiprocessing find it)."""
    path = os.path.abspath(target)
    sys.path[0] = os.path.dirname(path)
    if not path.endswith(".py") and (os.path.isdir(path) or zipfile.is_zipfile(path)):
        runpy.run_path(path, run_name="__main__")  # a folder or zip with __main__.py
        return
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - the user's script, as python itself runs it


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
    if STATE_DIR:
        with contextlib.suppress(OSError):  # when it ended, for the launcher's root cause
            protocol.write_ended(STATE_DIR, RANK, status)
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


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
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


if __name__ == "__main__":
    main(sys.argv[1:])
