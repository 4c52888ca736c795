"""Stop signals as requests (the launcher's `Signals`): the same signal repeated is one request,
as coreutils' `timeout` sends its SIGTERM to ddpkit and again to ddpkit's process group; only a
person's second Ctrl+C (SIGINT again, later than an echo) asks to kill at once. One row a case:
(signals received, seconds between them) -> (requests, the request's signal, urgent)."""

from __future__ import annotations

import signal

import pytest

from ddpkit.launch.base.worker import ECHO_S, Signals

TERM, INT, USR1 = signal.SIGTERM, signal.SIGINT, signal.SIGUSR1

ROWS = [
    # (signals, gap between two, requests, the request's signal, urgent)
    ((TERM,), 0.0, 1, TERM, False),
    ((TERM, TERM), 0.02, 1, TERM, False),  # timeout(1): to ddpkit, then to its group
    ((TERM, TERM), 0.5, 1, TERM, False),  # a scheduler's second SIGTERM, by hand
    ((TERM, TERM, TERM), 2.0, 1, TERM, False),
    ((USR1, USR1), 0.2, 1, USR1, False),  # SLURM's pre-emption warning, to step and task
    ((INT, INT), 0.01, 1, INT, False),  # one press delivered twice: its echo
    ((INT, INT), ECHO_S + 0.2, 1, INT, True),  # a person's second Ctrl+C
    ((TERM, INT), 1.0, 1, TERM, True),  # Ctrl+C after a scheduler's stop: the person's word
    ((INT, TERM), 1.0, 1, INT, False),
]


@pytest.mark.parametrize(("received", "gap", "requests", "first", "urgent"), ROWS)
def test_a_signal_repeated_is_one_request_and_only_a_second_ctrl_c_is_urgent(
    received, gap, requests, first, urgent
):
    clock = [100.0]
    signals = Signals(clock=lambda: clock[0])
    for signum in received:
        signals.handle(signum, None)
        clock[0] += gap
    assert (signals.count, signals.last, signals.urgent) == (requests, first, urgent)
    assert signals.received == len(received)
