"""What the launcher holds of each rank it started (`Worker`: its process, its output, how it
ended) and of the signals it received (`Signals`): the two types every launch module names."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from ddpkit.launch.base.output import RankOutput

ECHO_S = 0.3  # a Ctrl+C this soon after the last one is its echo, not a person's second press


@dataclass
class Signals:
    """The stop requests the launcher received (any of FORWARDED). The same request may come
    twice: coreutils' `timeout` sends its SIGTERM to ddpkit and again to its process group, a
    scheduler may signal the job step and then its processes. So a signal repeated is one
    request (`count` stays 1), and only a second Ctrl+C, pressed by a person (SIGINT again,
    later than an echo would come), is `urgent`: kill at once."""

    count: int = 0
    last: int = 0  # the request's signal (the first one received)
    received: int = 0  # every signal, repeats included
    urgent: bool = False
    at: float = 0.0  # when the last signal came, by `clock`
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        now = self.clock()
        self.received += 1
        if self.count == 0:
            self.count, self.last = 1, signum
        elif signum == signal.SIGINT and now - self.at >= ECHO_S:
            self.urgent = True
        self.at = now

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
    killed_at_once: bool = False  # SIGKILLed on a second Ctrl+C, before the grace was over
    rss: int = 0  # bytes its process tree held when last sampled (the hang watch's sample)

    @property
    def pgid(self) -> int:
        return self.proc.pid  # each worker leads its own session and group
