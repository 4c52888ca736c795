"""What the launcher holds of each rank it started (`Worker`: its process, its output, how it
ended) and of the signals it received (`Signals`): the two types every launch module names."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from types import FrameType

from ddpkit.launch.output import RankOutput


@dataclass
class Signals:
    """The signals the launcher received (any of FORWARDED)."""

    count: int = 0
    last: int = 0

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.last = signum

    def reason(self) -> str | None:
        """Why to give up a wait (`wait.Wait`'s give_up): the stop signal received, if any."""
        return signal.Signals(self.last).name if self.count else None


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    output: RankOutput
    exit_code: int | None = None
    ended_wall: float = 0.0
    stopped: bool = False  # ended by the launcher's teardown, not by itself
    rss: int = 0  # bytes its process tree held when last sampled (the hang watch's sample)

    @property
    def pgid(self) -> int:
        return self.proc.pid  # each worker leads its own session and group
