"""Ranks forked from the launcher's own process, for `ddpkit.spawn` of a function that a new
process cannot import again (defined in a notebook's kernel): each rank is a fork of the
kernel, which runs the bootstrap's steps and then the function, as Accelerate's
notebook_launcher and mp.spawn's fork method do.

`start(call, env, ...)` forks and runs `call` (the rank's bootstrap for a forked function,
given by ddpkit.spawn: the launcher imports nothing of the rank side). It returns a `Forked`:
what the launcher uses of a subprocess.Popen (pid, poll, wait, returncode, the pipe of its
output), so a forked rank is watched, stopped and reported as any other. Before it forks, the
caller has checked that CUDA is not initialised in this process (a forked child cannot use it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any


class Forked:
    """A forked rank, as the launcher sees a started process."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self.args = ["<forked>"]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(call: tuple[Callable[..., Any], tuple[Any, ...]], env: dict[str, str],
          forwarded: Sequence[int]) -> Forked:  # fmt: skip
    """Fork a rank that runs `call` in the environment `env`; its stdout and stderr go to one
    pipe, as a started rank's do; the signals the launcher forwards are the child's own again."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank
        try:
            os.setsid()  # its own group, as start_new_session gives a started rank
            os.close(read)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(write, 1)
            os.dup2(write, 2)
            os.close(write)
            for sig in forwarded:  # the launcher's handlers are not the rank's
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ.clear()
            os.environ.update(env)
            # the kernel's streams (ipykernel's) would write into its sockets: fd 1 and 2 here
            sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the rank's own, for its life
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            entry, arguments = call
            entry(*arguments)
        finally:
            os._exit(1)  # run_forked ends the process itself; never back into the kernel
    os.close(write)
    return Forked(pid, os.fdopen(read, "rb"))
