"""The launcher's decisions, as pure functions of what it observed: no process, no file, no
clock. The supervisor observes (`Observation`), asks `decide` what the observation means, and
acts; after an attempt it asks `after_attempt` what comes next. Both are tested as tables
(tests/unit/test_launcher_decisions.py), as torch elastic tests its agent's decisions.

The order of `decide` is the priority between things that can be true at once: a stop signal
the user sent outranks everything (the user asked); a rank's failure outranks what follows from
it (a closed console, another node's abort); another node's word outranks a node found lost (it
knows why); success is success only when nothing went wrong; a hang and a rank missing at init
are verdicts of the watches, called only while nothing else has happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    GO_ON = "go on"
    INTERRUPTED = "interrupted"  # the launcher got a stop signal (Ctrl+C, SIGTERM, ...)
    RANK_FAILED = "rank failed"  # a rank exited non-zero, or recorded an error and hangs on
    CONSOLE_CLOSED = "console closed"  # the reader of the launcher's output went away
    OTHER_NODE = "other node"  # another node stopped the job and said why (or nodes join)
    NODE_LOST = "node lost"  # another node (or node 0, to this one) is gone
    SUCCESS = "success"  # every rank exited 0
    HUNG = "hung"  # no rank made progress for --hang-timeout
    MISSING_AT_INIT = "missing at init"  # ranks waited --init-timeout for one that never came


@dataclass(frozen=True)
class Observation:
    """What the supervisor saw in one look at the job (all plain data)."""

    signal: int | None = None  # the last stop signal the launcher got, if any
    failed: tuple[int, ...] = ()  # ranks that failed
    running: tuple[int, ...] = ()  # ranks still running
    console_closed: bool = False
    other_node_said: bool = False  # an abort (or a membership change) from another node
    node_lost: bool = False
    hung: bool = False
    missing_at_init: bool = False


def decide(seen: Observation) -> Verdict:
    """What an observation means, by priority (the module's docstring says why this order)."""
    if seen.signal is not None:
        return Verdict.INTERRUPTED
    if seen.failed:
        return Verdict.RANK_FAILED
    if seen.console_closed:
        return Verdict.CONSOLE_CLOSED
    if seen.other_node_said:
        return Verdict.OTHER_NODE
    if seen.node_lost:
        return Verdict.NODE_LOST
    if not seen.running:
        return Verdict.SUCCESS
    if seen.hung:
        return Verdict.HUNG
    if seen.missing_at_init:
        return Verdict.MISSING_AT_INIT
    return Verdict.GO_ON


class Next(Enum):
    DONE = "done"  # the job ends with the attempt's exit code
    RESTART = "restart"  # --max-restarts: the whole group starts again
    NEW_ROUND = "new round"  # nodes joined or left (--nnodes MIN:MAX): meet again, no failure


@dataclass(frozen=True)
class Attempt:
    """How an attempt ended, as `after_attempt` needs it."""

    ok: bool
    restartable: bool = True  # the failure allows a restart (a lost node, a signal do not)
    membership: bool = False  # the nodes change: a new round
    signalled: bool = False  # the launcher got a stop signal
    attempt: int = 0  # restarts so far
    max_restarts: int = 0


def after_attempt(done: Attempt) -> Next:
    """What follows an attempt: the end, a restart, or a new round of membership."""
    if done.ok:
        return Next.DONE
    if done.signalled:
        return Next.DONE  # the user asked the job to stop
    if done.membership:
        return Next.NEW_ROUND
    if done.restartable and done.attempt < done.max_restarts:
        return Next.RESTART
    return Next.DONE


def goes_on(
    nnodes: int, min_nodes: int, restarts_left: int, rendezvous_lost: bool = False
) -> tuple[bool, str]:
    """When one of `nnodes` nodes is lost: whether the nodes left go on without it (an elastic
    job, --nnodes MIN:MAX, with at least MIN left, a restart to spare, and the node that serves
    the rendezvous among them), and the words that end the lost node's line. `min_nodes` 0: a
    job that is not elastic, which ends as it always did."""
    left = nnodes - 1
    if not min_nodes:
        return False, ""
    if rendezvous_lost:
        return False, "; it served the rendezvous, without which the nodes left cannot meet"
    if left < min_nodes:
        return False, f"; {_nodes(left)} left, fewer than --nnodes MIN {min_nodes}: the job ends"
    if restarts_left <= 0:
        return (
            False,
            f"; the {_nodes(left)} left would go on with a restart to spare (--max-restarts)",
        )
    return True, f"; the {_nodes(left)} left go{'es' if left == 1 else ''} on"


def _nodes(n: int) -> str:
    return "1 node" if n == 1 else f"{n} nodes"
