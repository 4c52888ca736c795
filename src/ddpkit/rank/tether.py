"""What ties a rank to its launcher: it dies with the launcher, and it answers the launcher's
request for its stacks even while blocked in C code.

`tie_to_launcher`: the kernel SIGKILLs this process when the launcher dies, even by SIGKILL
(PR_SET_PDEATHSIG). `dump_stacks_on_signal`: faulthandler writes every thread's stack to the
rank's stack file on protocol.STACKS_SIGNAL (ddpkit.launch.base.asking's STACKS question), and on
a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) into the rank's fault file, so the
report names the line it died at.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal

from ddpkit.common import protocol
from ddpkit.rank import runtime

PR_SET_PDEATHSIG = 1


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


def dump_stacks_on_signal() -> None:
    """Stacks on the launcher's request, and on a fatal signal (SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE, SIGILL) into the rank's fault file, so the report names the line it died at."""
    here = runtime.current()
    if not here.state_dir:
        return
    stacks = open(here.path(protocol.STACKS), "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(protocol.STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    if not faulthandler.is_enabled():  # `python -X faulthandler`'s choice is the user's
        fault = open(here.path(protocol.FAULT), "w")  # noqa: SIM115 - open for the process's life
        faulthandler.enable(file=fault, all_threads=True)
