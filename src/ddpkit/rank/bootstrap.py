"""The first code a worker runs: ties the worker to the launcher, then runs the user's script.

`python -m ddpkit.rank.bootstrap script|module|command TARGET [ARGS...]`
`python -m ddpkit.rank.bootstrap function SCRIPT|MODULE QUALNAME ARGS_FILE` (ddpkit.spawn)

Before the user's code, in this order, each concern in a module of its own:

    tether        the kernel SIGKILLs this process when the launcher dies; faulthandler
                  answers the launcher's request for stacks and writes where a fatal
                  signal struck
    init_args     the launcher's world size, rank and address, remembered before the script
                  can change them (the verdict on a script that passes others)
    memory        a small reserve released at an out-of-memory error (room for the report)
    streams       stdout buffered, stderr framed, into the launcher's one pipe
    progress      the progress record and its tick thread
    import_hooks  init_process_group, the sampler, backward, the optimizer and the
                  DataLoader watched as torch imports them
    failure       an uncaught exception written with its time to the rank's error file, so
                  the launcher tells the root cause from the ranks that failed because of it

The script then runs as `__main__`, as `python script.py` would run it; how it ends (its exit
code said, its files flushed, its traceback without ddpkit's frames) is `ending`'s.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import os
import runpy
import signal
import sys
import traceback
import types
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import runtime, streams, tether
from ddpkit.rank.ending import exit_quickly, user_frames
from ddpkit.rank.import_hooks import ImportWatcher

PR_SET_NAME = 15


def set_phase(phase: str) -> None:
    """Record this rank's phase (started / init / ready) for the launcher."""
    from ddpkit.rank.progress import set_phase as tell

    tell(phase)


def main(argv: list[str]) -> None:
    kind, target, *args = argv
    prepare(kind, target, args)
    sys.argv = [target, *args] if kind != "function" else sys.argv[:1]
    if kind == "function":
        from ddpkit.rank.spawned import run_function

        run(lambda: run_function(target, *args))
    elif kind == "module":
        sys.path.insert(0, os.getcwd())
        run(lambda: runpy.run_module(target, run_name="__main__", alter_sys=True))
    else:
        run(lambda: run_script(target))


def run_forked(fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """A rank forked from the process that called ddpkit.spawn (a notebook's kernel, whose
    function cannot be imported again): `fn(local_rank, *args)`, as main runs a script."""
    prepare("function", "", [])
    run(lambda: fn(int(os.environ.get("LOCAL_RANK", "0")), *args))


def prepare(kind: str, target: str, args: list[str]) -> None:
    """Everything before the user's code (the module docstring's list)."""
    tether.tie_to_launcher()
    store_fd = os.environ.get(protocol.STORE_FD)
    if store_fd:  # the rank's own children (loader workers, subprocesses) never get it
        with contextlib.suppress(OSError, ValueError):
            os.set_inheritable(int(store_fd), False)
    os.environ[protocol.RANK_PID] = str(os.getpid())  # children inherit it: "not the rank"
    runtime.start()  # the environment read once, for every part of the rank
    set_phase("started")
    if kind == "command":
        os.execvp(target, [target, *args])  # noqa: S606 - death signal survives exec
    from ddpkit.rank import init_args, oom_facts

    init_args.remember_launcher()  # before the script can change them
    oom_facts.reserve()
    if os.environ.get(protocol.FRAMED) == "1":
        streams.buffer_stdout()
        streams.frame_stderr()
    tether.dump_stacks_on_signal()
    from ddpkit.rank import progress

    progress.start_ticking()
    watcher = ImportWatcher()
    watcher.watch_loaded()  # a warm spare's torch, imported before it took its place
    if watcher.targets:
        sys.meta_path.insert(0, watcher)
    from ddpkit.errors import install_excepthook

    install_excepthook()
    from ddpkit.rank import failure

    failure.record_errors()


def run(user_code: Callable[[], object]) -> None:
    """Run the user's code and end as `python script.py` ends (never returns)."""
    try:
        user_code()
    except SystemExit as done:
        if done.code not in (None, 0):
            code = done.code if isinstance(done.code, int) else 1
            from ddpkit.rank.failure import write_error

            write_error("SystemExit", f"sys.exit({done.code!r})", exit_code=code)
            sys.last_value = done  # ddpkit's close sees a failure: no barrier with the peers
        exit_quickly(done.code)
    except KeyboardInterrupt as interrupt:
        # as `python script.py` ends on Ctrl+C (the traceback, then death by SIGINT), minus
        # the frames of ddpkit's own; the traceback in the rank's log
        trimmed = user_frames(interrupt.__traceback__)
        text = "".join(
            traceback.format_exception(type(interrupt), interrupt.with_traceback(trimmed), trimmed)
        )
        if os.environ.get(protocol.FRAMED) == "1":
            from ddpkit.rank.failure import log_only

            # the Ctrl+C ddpkit run forwarded: its report says the job was stopped, and every
            # rank's traceback (12 lines, ~30 from inside a collective) would bury it
            log_only(text)
        else:
            sys.stderr.write(text)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException as err:
        # Report it as `python script.py` would: without this file's and runpy's frames.
        trimmed = user_frames(err.__traceback__)
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


def wait_as_spare(control: int) -> None:
    """A warm spare (`--spare FD`, ddpkit.launch.spares): import torch now, while the job
    trains, then wait for the launcher's word on `control` to take its place in a restarted
    attempt. The environment is already that attempt's; EOF (the launcher is done with it, or
    gone) ends it quietly."""
    tether.tie_to_launcher()
    name = _name_process(protocol.SPARE_NAME)  # `ddpkit ps` tells a spare from a rank by it
    # when memory runs out the kernel ends spares first: a spare must never cost a rank
    adjusted = _oom_score_adj(b"1000")
    with contextlib.suppress(Exception):  # the script will meet the same error and say it
        import torch  # noqa: F401
    listed = b""
    while not listed.endswith(b"\n"):  # first: where the last attempt's imports are listed
        byte = os.read(control, 1)  # one at a time: the word to go may follow at once
        if not byte:
            os._exit(0)
        listed += byte
    _import_listed(listed.decode().strip())
    try:
        word = os.read(control, 1)
    except OSError:
        word = b""
    if not word:
        os._exit(0)
    os.close(control)
    _name_process(name)
    _oom_score_adj(adjusted)  # back to the rank's (raising and lowering back needs no privilege)


def _oom_score_adj(value: bytes) -> bytes:
    """Set this process's OOM score adjustment; the one it had (b"" where it cannot)."""
    try:
        with open("/proc/self/oom_score_adj", "r+b") as adj:  # noqa: PTH123
            before = adj.read().strip()
            if value:
                adj.seek(0)
                adj.write(value)
        return before
    except OSError:
        return b""


def _name_process(name: bytes) -> bytes:
    """Set this process's name (its comm: `ps -e`, psutil's name()); the name it had."""
    try:
        with open("/proc/self/comm", "rb") as comm:  # noqa: PTH123
            before = comm.read().strip()
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        return b""
    return before


def _import_listed(path: str) -> None:
    """The modules a rank of the last attempt imported from installed packages (DDP's
    torch._dynamo alone is a second here; transformers several)."""
    import importlib

    try:
        with open(path) as listing:  # noqa: PTH123
            names = listing.read().split()
    except OSError:
        return
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: S112 - what will not import early is imported late
                continue


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--spare"]:
        wait_as_spare(int(argv[1]))
        argv = argv[2:]
    main(argv)
