"""A rank's death in its own words: the error it recorded (a DataLoader worker's own
exception, not torch's wrapper; the line of the user's code it came from), the line a fatal
signal hit (faulthandler's dump in the rank's fault file), whether the kernel's OOM killer ended
it (the memory cgroup's oom_kill counter, or the kernel log where it can be read). Which rank is
the cause, and the fix, are decided by the rules of ddpkit.launch.diagnosis.
"""

from __future__ import annotations

import os
import re
import signal

from ddpkit.common import protocol
from ddpkit.common.host_memory import memory_cgroup, memory_limit, oom_kills
from ddpkit.common.units import size
from ddpkit.launch.base.snapshot import RankView

# signals after which faulthandler has written the rank's stack to its fault file
FATAL = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)

SAME_MOMENT = 1.0  # seconds within which ranks failing the same way failed together
VICTIM_WORDS = protocol.VICTIM_WORDS  # a rank's error that says a peer failed first


def same_error(a: protocol.ErrorRecord, b: protocol.ErrorRecord) -> bool:
    """The same error on two ranks: its type, and its words but for the numbers in them."""
    return a.type == b.type and re.sub(r"\d+", "#", a.message) == re.sub(r"\d+", "#", b.message)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"exited with code {code}"


def exit_code_of(code: int) -> int:
    """A rank's return code as a shell would report it: 128+N for signal N."""
    return 128 - code if code < 0 else code


_WORKER = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)")
_TB_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def error_text(error: protocol.ErrorRecord) -> str:
    """'ValueError: bad sample 17': the error's own words. A DataLoader worker's exception is
    the worker's own (torch wraps it in 'Caught ValueError in DataLoader worker process 1')."""
    kind, message = error.type, error.message.strip()
    worker = _WORKER.search(message)
    if worker and "Original Traceback" in message:
        original = message.split("Original Traceback", 1)[1]
        last = original.strip().splitlines()[-1] if original.strip() else ""
        own = last.split(": ", 1)[1] if ": " in last else last
        kind = f"{worker.group(1)} in DataLoader worker {worker.group(2)}"
        message = own
    elif message:
        message = message.splitlines()[0] if len(message.splitlines()) > 1 else message
    return f"{kind}: {message if error.whole else short(message)}"


def error_site(error: protocol.ErrorRecord) -> str:
    """The innermost line of the user's code the error came from ('train.py:42 in step')."""
    message = error.message
    if _WORKER.search(message) and "Original Traceback" in message:
        return _user_site(message.split("Original Traceback", 1)[1])
    return _user_site(error.traceback)


def _user_site(trace: str) -> str:
    """The innermost frame of a traceback's text outside torch, ddpkit and Python."""
    from ddpkit.common.frames import is_library

    frames = [m for m in _TB_FRAME.findall(trace) if not is_library(m[0])]
    if not frames:
        return ""
    file, line, func = frames[-1]
    return f"{os.path.basename(file)}:{line} in {func}"


def short(message: str, limit: int = 160) -> str:
    message = _SOURCE_PREFIX.sub("", message)
    return message if len(message) <= limit else message[: limit - 3] + "..."


# gloo's and c10d's messages begin with the C++ file that raised them: noise to a user
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ")


def fault_site(text: str) -> str:
    """Where a rank that died of a fatal signal was: 'crash.py:12 in <module>', from
    faulthandler's dump of its main thread (`text`, its fault file), or ''."""
    from ddpkit.common.frames import code_site, main_thread, parse_threads, user_frames

    frames = main_thread(parse_threads(text))
    if not frames:
        return ""
    ours = user_frames(frames)
    site = code_site(frames)
    inner = frames[0]
    call = (
        f" (in {inner.func}, {os.path.basename(inner.file)})"
        if ours and inner is not ours[0]
        else ""
    )
    func = f" in {ours[0].func}" if ours and not ours[0].func.startswith("<") else ""
    return f"{site}{func}{call}" if site != "?" else ""


# -- the kernel's OOM killer ------------------------------------------------------------------


_KMSG_KILL = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+)")
_KMSG_OOM = re.compile(r"oom-kill:.*\bpid=(\d+)")


def killed_by_oom_in_kernel_log(pids: set[int]) -> bool:
    """The kernel log (/dev/kmsg, root only) says the OOM killer ended one of `pids`."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    found = False
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the ring overwrote a record; go on reading
                continue
            if not record:
                break
            for pattern in (_KMSG_KILL, _KMSG_OOM):
                match = pattern.search(record)
                if match and int(match.group(1)) in pids:
                    found = True
    finally:
        os.close(fd)
    return found


def gib(n: int) -> str:
    return size(n)


class OomWatch:
    """The OOM-kill count of the launcher's memory cgroup when the attempt began (the ranks
    live in it too, as in a SLURM step or a pod), to tell a SIGKILL from the kernel's OOM killer
    from any other."""

    def __init__(self) -> None:
        self.folder = memory_cgroup()
        self.kills = oom_kills(self.folder)

    def killed(self, pids: set[int]) -> bool:
        return oom_kills(self.folder) > self.kills or killed_by_oom_in_kernel_log(pids)

    def text(self, rss: int) -> str:
        limit = memory_limit(self.folder)
        where = f"the job's memory cgroup (limit {gib(limit)})" if limit else "the machine"
        held = f"; its processes last held {gib(rss)}" if rss else ""
        return f"was killed by the kernel's OOM killer: {where} ran out of memory{held}"


OOM_FIX = (
    "use less host memory per rank (a smaller batch, fewer DataLoader workers, a dataset that "
    "reads from disk instead of memory), run fewer ranks per node (-n), or raise the job's "
    "memory limit (SLURM's --mem, the pod's resources.limits.memory)"
)
_WORKER_KILLED = re.compile(r"DataLoader worker \(pids?\s*([\d, ]+)\) is killed by signal")


def the_one_that_held_most(
    root: RankView,
    failed: tuple[RankView, ...],
    errors: dict[int, protocol.ErrorRecord],
    oom: OomWatch,
) -> tuple[RankView, list[RankView]]:
    """Of the ranks SIGKILLed at the root's moment, the one that held the most memory, when the
    OOM killer ended them: the kernel may end a second rank before the first one's memory is
    freed, and which exit the launcher reaps first is chance. The others, as its victims (said
    as SIGKILLed with it: which signal came from the kernel, only root may read)."""
    together = [
        w
        for w in failed
        if w.exit_code == -signal.SIGKILL
        and w.rank not in errors
        and abs(w.ended_wall - root.ended_wall) < SAME_MOMENT
    ]
    if len(together) < 2 or not oom.killed({w.pid for w in together}):
        return root, []
    most = max(together, key=lambda w: (w.rss, -w.rank))
    return most, sorted((w for w in together if w is not most), key=lambda w: w.rank)


def killed_worker_pids(error: protocol.ErrorRecord | None) -> set[int]:
    """The DataLoader worker pids torch says were killed by a signal."""
    if error is None:
        return set()
    match = _WORKER_KILLED.search(error.message)
    return {int(p) for p in re.findall(r"\d+", match.group(1))} if match else set()
