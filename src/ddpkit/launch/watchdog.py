"""A tiny process that outlives a SIGKILLed launcher just long enough to end its job.

`python -m ddpkit.launch.watchdog RUN_ID GRACE LAUNCHER_PID`, started by the launcher in a
session of its own with a pipe on stdin. The launcher writes `group PGID` for each worker and
`done` when it has cleaned up itself. If stdin closes without `done`, the launcher died: every
process group it named and every process whose environment carries the run id and the
launcher's pid (data-loader workers, subprocesses, even those that left the group or ignore
SIGTERM) is terminated, then killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from ddpkit.common import protocol


def main(run_id: str, grace: float, launcher_pid: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the launcher's to handle
    groups: list[int] = []
    for line in sys.stdin:
        word, _, value = line.strip().partition(" ")
        if word == "group":
            groups.append(int(value))
        elif word == "done":
            return 0
    from ddpkit.common.procs import processes_of_job, terminate

    terminate(processes_of_job(run_id, launcher_pid), grace, groups=groups)
    return 0


# -- the launcher's side -------------------------------------------------------------------


def start(run_id: str, grace: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit.launch.watchdog", run_id, str(min(grace, 1.0)),
         str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if k not in protocol.WORKER_VARIABLES},
    )  # fmt: skip


def tell(watchdog: subprocess.Popen[bytes], line: str) -> None:
    with contextlib.suppress(OSError):
        assert watchdog.stdin is not None
        watchdog.stdin.write(line.encode() + b"\n")
        watchdog.stdin.flush()


def finish(watchdog: subprocess.Popen[bytes]) -> None:
    """The launcher cleaned up itself: the watchdog ends without touching anything."""
    tell(watchdog, "done")
    with contextlib.suppress(OSError):
        assert watchdog.stdin is not None
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
