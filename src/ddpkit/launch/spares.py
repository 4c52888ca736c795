"""Warm spares: a restart whose ranks have already imported torch (issue 38, "restart in
seconds"). Once every rank of an attempt is ready and restarts are left, the launcher starts
one spare per local rank for the next attempt: the same command line as its worker (`ps`
shows the script), the next attempt's environment exactly, its own session, tied to the
launcher, told to the watchdog. A spare imports torch while the job trains, then waits on a
pipe. At the restart each rank whose environment is the one its spare was given takes the
spare (one byte down the pipe: ddpkit.rank.bootstrap goes on as a fresh worker would, its
output read into the rank's log from then); any other rank (a new round moved the ranks) starts
cold, and its spare is ended. Spares left at the job's end are ended with it.

Cost: one idle process per local rank holding torch's import (~0.3 GB of host memory on the
CPU build), and the import's CPU time once per attempt, after start-up. `--no-spares` (or
DDPKIT_NO_SPARES=1) starts every attempt cold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.worker import Worker
from ddpkit.launch.workers import stdin_rank, worker_command, worker_of

log = logging.getLogger(__name__)


@dataclass
class Spare:
    rank: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    control: int  # the pipe's write end: one byte, and the spare takes its place


class Spares:
    """The spares of the next attempt, by rank."""

    def __init__(self) -> None:
        self.waiting: dict[int, Spare] = {}
        self.for_start: tuple[int, int] | None = None  # (attempt, rounds) they were made for

    @property
    def pids(self) -> set[int]:
        return {s.proc.pid for s in self.waiting.values()}

    def start(
        self,
        cfg: LaunchConfig,
        envs: dict[int, dict[str, str]],
        key: tuple[int, int],
        modules: Path | None,
    ) -> list[int]:
        """One spare per rank, each with its worker's environment for the next attempt, told
        where the modules to import are listed (`modules`: a rank's list from this attempt);
        their process groups (for the watchdog)."""
        self.for_start = key
        groups = []
        for rank, env in envs.items():
            read, write = os.pipe()
            store_fd = env.get(protocol.STORE_FD)
            passed = (read, int(store_fd)) if store_fd else (read,)
            proc = subprocess.Popen(
                worker_command(cfg, env, spare=read),
                env=env,
                stdin=None if stdin_rank(cfg) == rank else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=passed,
            )
            os.close(read)
            os.write(write, f"{modules or ''}\n".encode())
            self.waiting[rank] = Spare(rank, env, proc, write)
            groups.append(proc.pid)
        return groups

    def take(self, cfg: LaunchConfig, rank: int, env: dict[str, str], run_dir: Path,
             key: tuple[int, int]) -> Worker | None:  # fmt: skip
        """The rank's spare as its worker, when it waits with this very environment."""
        spare = self.waiting.pop(rank, None)
        if spare is None:
            return None
        if key != self.for_start or spare.env != env or spare.proc.poll() is not None:
            differ = sorted(k for k in {*env, *spare.env} if env.get(k) != spare.env.get(k))
            log.debug("rank %d starts cold: spare for %s, now %s; its exit %s; variables "
                      "that differ: %s", rank, self.for_start, key, spare.proc.poll(),
                      differ)  # fmt: skip
            _end(spare)
            return None
        try:
            os.write(spare.control, b"g")
        except OSError:  # it died just now
            _end(spare)
            return None
        os.close(spare.control)
        return worker_of(cfg, rank, env, run_dir, spare.proc)

    def end(self) -> None:
        """Every spare still waiting ends."""
        while self.waiting:
            _end(self.waiting.popitem()[1])
        self.for_start = None


def _end(spare: Spare) -> None:
    """A spare holds nothing yet: it is killed, not asked (it may be inside torch's import)."""
    with contextlib.suppress(OSError):
        os.close(spare.control)
    with contextlib.suppress(OSError):
        os.killpg(spare.proc.pid, signal.SIGKILL)
    spare.proc.wait()
    if spare.proc.stdout is not None:
        spare.proc.stdout.close()


def wanted(cfg: LaunchConfig, attempt: int) -> bool:
    """Spares are worth their memory when a restart can still come and the ranks run Python."""
    return cfg.spares and cfg.kind != "command" and cfg.max_restarts - attempt > 0
