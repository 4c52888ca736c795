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
import functools
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
from ddpkit.common.frames import is_library
from ddpkit.rank.steps import waited_in_collective

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
        from ddpkit.rank import steps

        self.targets = {
            "torch.distributed.distributed_c10d": patch_init,
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


_store_server: Any = None  # the job's TCPStore, when this rank serves it (kept to the end)


def serve_store() -> None:
    """Rank 0 of a one-node job: serve the job's store on the launcher's listening socket, as
    soon as torch.distributed is imported (the peers' connections wait in its backlog till
    then). init_process_group and ddpkit.setup() find it by its port (multi-tenant)."""
    global _store_server
    fd = os.environ.pop(protocol.STORE_FD, None)
    if fd is None or _store_server is not None:
        return
    from ddpkit.common.store_server import serve_fd

    port = int(os.environ.get("MASTER_PORT", "0"))
    timeout = float(os.environ.get(protocol.INIT_TIMEOUT, "330"))
    try:
        _store_server = serve_fd(int(fd), "127.0.0.1", port, timeout, multi_tenant=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(int(fd))


def patch_init(module: ModuleType) -> None:
    """Serve the job's store (rank 0 of one node); mark when this rank enters and leaves
    init_process_group; record its collectives."""
    try:
        serve_store()
    except Exception as err:  # the peers then time out at init, and the report says why
        from ddpkit.errors import debug_note

        debug_note("serving the job's store", err)
    original = module.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        set_phase("init")
        result = original(*args, **kwargs)
        set_phase("ready")
        if STATE_DIR:
            timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
            record_group(str(module.get_backend()), timeout)
            from ddpkit.rank import memory

            memory.start_history()  # --memory-snapshot: the allocator's events, from here on
        if STATE_DIR and _recording():
            from ddpkit.rank import flight

            flight.serve(STATE_DIR, RANK, str(module.get_backend()))
        return result

    module.init_process_group = init_process_group  # type: ignore[attr-defined]
    track_collectives(module)


def record_group(backend: str, timeout: Any) -> None:
    """The group's backend and collective timeout, for the launcher's long-wait note."""
    if timeout is None:
        from torch.distributed import constants

        default = constants.default_pg_timeout
        if backend == "nccl":
            default = getattr(constants, "default_pg_nccl_timeout", None) or default
        timeout = default
    try:
        protocol.write_group(STATE_DIR, RANK, backend, float(timeout.total_seconds()))
    except (OSError, AttributeError):
        pass


_depth = 0


def _recording() -> bool:
    """The flight recorder keeps entries (the launcher sets its buffer unless told not to)."""
    if os.environ.get(protocol.TRACK) == "0":
        return False
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    return bool(size and size.strip().isdigit() and int(size) > 0)


def track_collectives(module: ModuleType) -> None:
    """Record each collective's start and end in this rank's progress record."""
    from ddpkit.rank import progress

    record = progress.writer()
    if record is None or os.environ.get(protocol.TRACK) == "0":
        return

    def wrap(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            global _depth
            if _depth:
                return original(*args, **kwargs)
            site, shapes = user_site(), describe_shapes(args)
            _depth += 1
            record.enter(name, shapes, site)
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _depth -= 1
                record.leave(name, shapes, site)
                waited_in_collective(time.perf_counter() - began)

        collective._ddpkit_original = original  # type: ignore[attr-defined]  # ddpkit's own calls
        return collective

    for name in protocol.COLLECTIVES:
        original = getattr(module, name, None)
        if callable(original):
            setattr(module, name, wrap(name, original))


def user_site() -> str:
    """file:line (function) of the innermost caller outside torch and ddpkit."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def describe_shapes(args: tuple[Any, ...]) -> str:
    shapes = []
    for arg in args[:2]:
        items = arg if isinstance(arg, list | tuple) else [arg]
        for item in items[:2]:
            shape = getattr(item, "shape", None)
            if shape is not None:
                shapes.append(str(list(shape)))
    return " ".join(shapes)


def write_error(
    kind: str, message: str, trace: str = "", exit_code: int | None = None, fix: str = ""
) -> None:
    """This rank's failure, timestamped, for the launcher's root-cause verdict."""
    if STATE_DIR:
        record = protocol.ErrorRecord(time.time(), kind, message, trace, exit_code, fix)
        try:
            protocol.write_error(STATE_DIR, RANK, record)
        except OSError:
            pass


def record_errors() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            from ddpkit.rank import memory
            from ddpkit.rank.hints import fix_for

            memory.write(STATE_DIR, RANK, value)  # an out-of-memory error: what memory held
            trace = "".join(traceback.format_exception(kind, value, tb))
            write_error(kind.__name__, str(value), trace, fix=fix_for(value, tb))
        previous(kind, value, tb)

    sys.excepthook = hook


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
    if os.environ.get(protocol.FRAMED) == "1":
        buffer_stdout()
        frame_stderr()
    dump_stacks_on_signal()
    from ddpkit.rank import progress

    progress.start_ticking()
    sys.meta_path.insert(0, _ImportWatcher())
    from ddpkit.errors import install_excepthook

    install_excepthook()
    record_errors()
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
    for obj in gc.get_objects():
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
