"""The launcher's one way to wait: for a condition, up to a deadline, giving up early when the
launcher got a stop signal or a peer was lost. Every blocking step of the launcher waits
through it (stacks and flight-recorder answers, other nodes' word, their places in a hang,
the end of a round, a store being served), so a Ctrl+C or a lost node cuts each of them short
in the same way, and none has a loop of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

POLL = 0.05  # seconds between looks


T = TypeVar("T")


@dataclass(frozen=True)
class Waited:
    """How a wait ended: done, or why not ('timeout', or what `give_up` said)."""

    done: bool
    why: str = ""


class Wait:
    """Waits that give up when `give_up()` returns a reason (a stop signal, a lost peer)."""

    def __init__(self, give_up: Callable[[], str | None] = lambda: None) -> None:
        self.give_up = give_up

    @property
    def cancelled(self) -> bool:
        return self.give_up() is not None

    def until(self, done: Callable[[], bool], seconds: float, poll: float = POLL) -> Waited:
        """Look at `done()` every `poll` s until it is true, `seconds` pass, or a reason to
        give up comes."""
        deadline = time.monotonic() + seconds
        while True:
            if done():
                return Waited(True)
            why = self.give_up()
            if why is not None:
                return Waited(False, why)
            left = deadline - time.monotonic()
            if left <= 0:
                return Waited(False, "timeout")
            time.sleep(min(poll, left))

    def call(self, fn: Callable[[], T], seconds: float) -> tuple[Waited, T | None]:
        """Run a blocking call on a thread and wait for it as `until` does; (how it ended, its
        result). An exception the call raised is raised here; a call given up on is left to
        finish on its daemon thread."""
        box: dict[str, T] = {}
        failed: list[BaseException] = []

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as err:  # handed to the caller
                failed.append(err)

        thread = threading.Thread(target=run, daemon=True, name="ddpkit-wait")
        thread.start()
        waited = self.until(lambda: not thread.is_alive(), seconds)
        if failed:
            raise failed[0]
        return waited, box.get("result")


def never() -> str | None:
    """A `give_up` that never gives up (a wait with nothing to watch but its deadline)."""
    return None
