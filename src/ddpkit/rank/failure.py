"""A rank's uncaught error: recorded for the launcher's verdict (its error file, with a fix
where the rank can tell one, and what memory held when it ran out), then shown.

Under `ddpkit run` the console is the job's, and the report at the end names the root cause
once, so two kinds of error go to the rank's log only:

* ddpkit's own error (a `DdpkitError`: what happened and the fix): every rank raises the same
  one, and the report prints it once;
* an error that says a peer failed or a wait timed out ("Connection closed by peer"): the
  console gets one line saying so, the rank's log the whole traceback.

Anything else prints as `python script.py` would print it.

A rank that failed waiting for a peer then runs `AFTER_A_PEER` (ddpkit.train.rescue: the state
of the last completed step, written by the ranks left) before it ends.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType

from ddpkit.common import protocol
from ddpkit.errors import DdpkitError
from ddpkit.rank import runtime

# what a rank does after it failed waiting for a peer, before it ends: (what it did, whether
# the console should hear it) or None (ddpkit.train.rescue adds the last step's state)
AFTER_A_PEER: list[Callable[[], tuple[str, bool] | None]] = []


def write_error(
    kind: str,
    message: str,
    trace: str = "",
    exit_code: int | None = None,
    fix: str = "",
    whole: bool = False,
) -> None:
    """This rank's failure, timestamped, for the launcher's root-cause verdict."""
    here = runtime.current()
    if here.state_dir:
        record = protocol.ErrorRecord(time.time(), kind, message, trace, exit_code, fix, whole)
        try:
            protocol.write_error(here.state_dir, here.rank_name, record)
        except OSError:
            pass


def log_only(text: str) -> None:
    """Into this rank's log, not the console (the launcher's LOG frame)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    data = protocol.LOG_START + text.encode(errors="backslashreplace") + protocol.LOG_END
    while data:
        try:
            data = data[os.write(2, data) :]
        except InterruptedError:
            continue
        except OSError:
            return


def say(text: str, loud: bool) -> None:
    """A line of ddpkit's: on the console (and so in the log) when loud, else in the log."""
    if loud:
        print(f"ddpkit: {text}", file=sys.stderr, flush=True)
    else:
        log_only(f"ddpkit: {text}\n")


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ")


def first_sentence(message: str, limit: int = 160) -> str:
    """An error's first sentence, without the C++ file gloo and c10d begin theirs with."""
    line = _SOURCE_PREFIX.sub("", (message.strip().splitlines() or [""])[0])
    cut = line.find(". ")
    line = line[: cut + 1] if 0 < cut < limit else line
    return line if len(line) <= limit else line[: limit - 3] + "..."


def waited_for_a_peer(message: str) -> bool:
    return any(word in message for word in protocol.WAITING_WORDS)


def record_errors() -> None:
    """Install the hook that records and shows an uncaught error (see the module's doc)."""
    previous = sys.excepthook
    framed = os.environ.get(protocol.FRAMED) == "1"

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            return
        from ddpkit.rank import oom_facts
        from ddpkit.rank.hints import fix_for

        oom_facts.release_reserve()  # room for what follows, when the process ran out
        here = runtime.current()
        oom_facts.write(here.state_dir, here.rank_name, value)  # an OOM: what memory held
        trace = "".join(traceback.format_exception(kind, value, tb))
        ours = isinstance(value, DdpkitError)
        fix = value.fix if isinstance(value, DdpkitError) else fix_for(value, tb)
        write_error(kind.__name__, str(value), trace, fix=fix, whole=ours)
        victim = waited_for_a_peer(str(value))
        if victim:
            for after in AFTER_A_PEER:
                did = after()
                if did is not None:
                    say(*did)
        if framed and isinstance(value, DdpkitError):
            log_only(value.render() + "\n")
        elif framed and victim:
            log_only(trace)
            print(
                f"{kind.__name__}: {first_sentence(str(value))} (this rank waited for a peer; "
                "the report names the rank at fault; the whole traceback is in this rank's log)",
                file=sys.stderr,
                flush=True,
            )
        else:
            previous(kind, value, tb)

    hook._ddpkit = True  # type: ignore[attr-defined]  # it shows a DdpkitError itself: setup() adds none
    sys.excepthook = hook
