"""The launcher's decisions as tables: what an observation means, and what follows an attempt.
No process runs here: the decisions are pure functions of plain data (ddpkit.launch.base.decide)."""

from __future__ import annotations

import itertools
import signal

import pytest

from ddpkit.launch.base.decide import (
    Attempt,
    Next,
    Observation,
    Verdict,
    after_attempt,
    decide,
    goes_on,
)
from ddpkit.launch.peers.rounds import check_round

RUNNING = (0, 1)

# one observation per row, and what it means
TABLE = [
    (Observation(running=RUNNING), Verdict.GO_ON),
    (Observation(running=()), Verdict.SUCCESS),
    (Observation(signal=signal.SIGINT, running=RUNNING), Verdict.INTERRUPTED),
    (Observation(failed=(1,), running=(0,)), Verdict.RANK_FAILED),
    (Observation(console_closed=True, running=RUNNING), Verdict.CONSOLE_CLOSED),
    (Observation(other_node_said=True, running=RUNNING), Verdict.OTHER_NODE),
    (Observation(node_lost=True, running=RUNNING), Verdict.NODE_LOST),
    (Observation(hung=True, running=RUNNING), Verdict.HUNG),
    (Observation(missing_at_init=True, running=RUNNING), Verdict.MISSING_AT_INIT),
    # several at once: the priority
    (Observation(signal=signal.SIGTERM, failed=(1,), running=(0,)), Verdict.INTERRUPTED),
    (Observation(failed=(1,), console_closed=True, running=(0,)), Verdict.RANK_FAILED),
    (Observation(failed=(0,), other_node_said=True, node_lost=True), Verdict.RANK_FAILED),
    (Observation(other_node_said=True, node_lost=True, running=RUNNING), Verdict.OTHER_NODE),
    (Observation(console_closed=True, node_lost=True, running=RUNNING), Verdict.CONSOLE_CLOSED),
    (Observation(node_lost=True, running=()), Verdict.NODE_LOST),
    (Observation(hung=True, running=()), Verdict.SUCCESS),
    (Observation(hung=True, missing_at_init=True, running=RUNNING), Verdict.HUNG),
    (Observation(failed=(2,), hung=True, running=(0, 1)), Verdict.RANK_FAILED),
]


@pytest.mark.parametrize(("seen", "meaning"), TABLE)
def test_an_observation_means_one_verdict(seen, meaning):
    assert decide(seen) == meaning


def test_a_stop_signal_outranks_every_other_observation():
    flags = ["console_closed", "other_node_said", "node_lost", "hung", "missing_at_init"]
    for values in itertools.product([False, True], repeat=len(flags)):
        seen = Observation(
            signal=signal.SIGTERM,
            failed=(1,),
            running=(0,),
            **dict(zip(flags, values, strict=True)),
        )
        assert decide(seen) == Verdict.INTERRUPTED


def test_nothing_but_a_signal_outranks_a_failed_rank():
    flags = ["console_closed", "other_node_said", "node_lost", "hung", "missing_at_init"]
    for values in itertools.product([False, True], repeat=len(flags)):
        seen = Observation(failed=(1,), running=(0,), **dict(zip(flags, values, strict=True)))
        assert decide(seen) == Verdict.RANK_FAILED


AFTER = [
    (Attempt(ok=True), Next.DONE),
    (Attempt(ok=True, max_restarts=3), Next.DONE),
    (Attempt(ok=False), Next.DONE),
    (Attempt(ok=False, max_restarts=1), Next.RESTART),
    (Attempt(ok=False, max_restarts=1, attempt=1), Next.DONE),
    (Attempt(ok=False, max_restarts=2, attempt=1), Next.RESTART),
    (Attempt(ok=False, max_restarts=1, restartable=False), Next.DONE),  # a lost node, not elastic
    (Attempt(ok=False, max_restarts=1, signalled=True), Next.DONE),  # the user stopped it
    (Attempt(ok=False, membership=True), Next.NEW_ROUND),
    (Attempt(ok=False, membership=True, max_restarts=0, attempt=5), Next.NEW_ROUND),
    (Attempt(ok=False, membership=True, signalled=True), Next.DONE),
]


@pytest.mark.parametrize(("done", "then"), AFTER)
def test_what_follows_an_attempt(done, then):
    assert after_attempt(done) == then


# (nodes before the loss, --nnodes MIN (0: not elastic), restarts left, the rendezvous's node
# lost) -> whether the nodes left go on, and how the lost node's line ends
LOSSES = [
    ((3, 0, 1, False), (False, "")),
    ((3, 2, 1, False), (True, "; the 2 nodes left go on")),
    ((2, 1, 1, False), (True, "; the 1 node left goes on")),
    ((2, 2, 1, False), (False, "; 1 node left, fewer than --nnodes MIN 2: the job ends")),
    (
        (3, 2, 0, False),
        (False, "; the 2 nodes left would go on with a restart to spare (--max-restarts)"),
    ),  # fmt: skip
    (
        (3, 2, 1, True),
        (False, "; it served the rendezvous, without which the nodes left cannot meet"),
    ),  # fmt: skip
]


@pytest.mark.parametrize(("loss", "then"), LOSSES)
def test_whether_the_nodes_left_after_a_loss_go_on(loss, then):
    assert goes_on(*loss) == then


# (rank, world, MIN) a node read from a rendezvous round, and whether it can be its own
ROUNDS = [
    ((0, 2, 2), None),
    ((1, 2, 1), None),
    ((1, 1, 1), "this node read rank 1 in a round of 1 node(s)"),  # dropped from under it
    ((0, 1, 2), "this node read a round of 1 node(s), fewer than --nnodes MIN 2"),
    ((-1, 2, 1), "this node read rank -1 in a round of 2 node(s)"),
]


@pytest.mark.parametrize(("read", "wrong"), ROUNDS)
def test_a_round_a_node_cannot_be_in_is_named(read, wrong):
    assert check_round(*read) == wrong
