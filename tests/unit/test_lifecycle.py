"""The job's step function driven through whole episodes with made-up snapshots, as torch
elastic's agent tests drive its agent: a failure that settles then restarts, a stop signal
during settling, a hang during a stop, a success, ranks missing at init. No process, no file,
no clock: each step gets the time in its events."""

from __future__ import annotations

import signal

from ddpkit.common import protocol
from ddpkit.launch.base.decide import Attempt, Verdict
from ddpkit.launch.base.snapshot import RankView, Snapshot
from ddpkit.launch.lifecycle import (
    SETTLE,
    SETTLE_WAITING,
    AnswerPlaces,
    Collect,
    DescribeWait,
    Events,
    Finish,
    Phase,
    Restart,
    Start,
    State,
    Watch,
    step,
)


def ranks(*views: RankView, wall: float = 1000.0) -> Snapshot:
    return Snapshot(views, wall=wall, mono=0.0)


def running(rank: int, **kw: object) -> RankView:
    return RankView(rank=rank, pid=100 + rank, phase="ready", **kw)  # type: ignore[arg-type]


def exited(rank: int, code: int, **kw: object) -> RankView:
    return RankView(rank=rank, pid=100 + rank, exit_code=code, phase="ready", **kw)  # type: ignore[arg-type]


def error(message: str, at: float = 999.0) -> protocol.ErrorRecord:
    return protocol.ErrorRecord(at, "RuntimeError", message)


def ended(ok: bool, attempt: int, max_restarts: int, **kw: bool) -> Attempt:
    return Attempt(ok=ok, attempt=attempt, max_restarts=max_restarts, **kw)


def test_a_job_starts_then_watches_its_ranks_while_they_run():
    state, actions = step(State(), ranks(), Events(now=0.0))
    assert (state.phase, actions) == (Phase.RUNNING, (Start(attempt=0, rounds=0),))
    state, actions = step(state, ranks(running(0), running(1)), Events(now=0.1))
    assert (state.phase, actions) == (Phase.RUNNING, (Watch(),))


def test_a_failure_settles_then_restarts_once_then_the_second_failure_ends_the_job():
    state, _ = step(State(), ranks(), Events(now=0.0))
    one_failed = ranks(running(0), exited(1, 1, error=error("boom")))
    state, actions = step(state, one_failed, Events(now=1.0))
    assert (state.phase, state.verdict, actions) == (Phase.SETTLING, Verdict.RANK_FAILED, ())
    # too soon: near-simultaneous exits get SETTLE s to land
    state, actions = step(state, one_failed, Events(now=1.0 + SETTLE / 2))
    assert (state.phase, actions) == (Phase.SETTLING, ())
    state, actions = step(state, one_failed, Events(now=1.0 + SETTLE + 0.01))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.RANK_FAILED),))
    state, actions = step(state, ranks(), Events(now=2.0, ended=ended(False, 0, 1)))
    assert (state.phase, state.attempt, state.rounds) == (Phase.RESTARTING, 1, 1)
    assert actions == (Restart(new_round=False),)
    state, actions = step(state, ranks(), Events(now=3.0))
    assert (state.phase, actions) == (Phase.RUNNING, (Start(attempt=1, rounds=1),))
    state, _ = step(state, one_failed, Events(now=4.0))
    state, _ = step(state, one_failed, Events(now=5.0))
    assert state.phase is Phase.STOPPING
    state, actions = step(state, ranks(), Events(now=6.0, ended=ended(False, 1, 1)))
    assert (state.phase, actions) == (Phase.DONE, (Finish(),))


def test_settling_waits_for_a_rank_that_recorded_its_error_but_not_past_the_bound():
    state = State(phase=Phase.SETTLING, since=0.0, verdict=Verdict.RANK_FAILED)
    landing = ranks(running(0, error=error("boom")), exited(1, 1, error=error("boom")))
    state, actions = step(state, landing, Events(now=SETTLE + 0.1))
    assert state.phase is Phase.SETTLING, "rank 0 recorded its error and is on its way out"
    state, actions = step(state, landing, Events(now=SETTLE + SETTLE_WAITING))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.RANK_FAILED),))


def test_a_stop_signal_while_settling_cuts_it_short_and_the_job_ends_without_restart():
    state = State(phase=Phase.SETTLING, since=0.0, verdict=Verdict.RANK_FAILED)
    landing = ranks(running(0, error=error("boom")), exited(1, 1))
    state, actions = step(state, landing, Events(now=0.01, signal=signal.SIGINT))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.RANK_FAILED),))
    done = ended(False, 0, 3, signalled=True)
    state, actions = step(state, ranks(), Events(now=0.02, ended=done))
    assert (state.phase, actions) == (Phase.DONE, (Finish(),))


def test_a_hang_is_collected_and_a_signal_during_its_stop_changes_nothing_until_it_ended():
    state = State(phase=Phase.RUNNING)
    state, actions = step(state, ranks(running(0), running(1)), Events(now=30.0, hung=True))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.HUNG),))
    # the stop is under way (the edge performs it): a signal now is the stop's business
    state, actions = step(state, ranks(), Events(now=31.0, signal=signal.SIGINT))
    assert (state.phase, actions) == (Phase.STOPPING, ())
    hung_job = ended(False, 0, 2, signalled=True)
    state, actions = step(state, ranks(), Events(now=32.0, ended=hung_job))
    assert (state.phase, actions) == (Phase.DONE, (Finish(),))


def test_every_rank_exiting_zero_is_success_and_the_end():
    state = State(phase=Phase.RUNNING)
    state, actions = step(state, ranks(exited(0, 0), exited(1, 0)), Events(now=5.0))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.SUCCESS),))
    state, actions = step(state, ranks(), Events(now=5.1, ended=ended(True, 0, 3)))
    assert (state.phase, actions) == (Phase.DONE, (Finish(),))


def test_a_rank_missing_at_init_is_a_verdict_once_the_others_waited_the_init_timeout():
    waiting = RankView(rank=0, pid=100, phase="init", phase_since=1000.0)
    absent = RankView(rank=1, pid=101, phase="started", phase_since=999.0)
    state = State(phase=Phase.RUNNING)
    early = ranks(waiting, absent, wall=1005.0)
    state, actions = step(state, early, Events(now=5.0, init_timeout=10))
    assert (state.phase, actions) == (Phase.RUNNING, (Watch(),))
    late = ranks(waiting, absent, wall=1011.0)
    state, actions = step(state, late, Events(now=11.0, init_timeout=10))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.MISSING_AT_INIT),))


def test_another_nodes_question_and_a_long_wait_are_answered_while_the_job_goes_on():
    state = State(phase=Phase.RUNNING)
    events = Events(now=1.0, hang_asked=True, long_wait=True)
    state, actions = step(state, ranks(running(0)), events)
    assert (state.phase, actions) == (Phase.RUNNING, (AnswerPlaces(), DescribeWait(), Watch()))


def test_a_change_of_membership_is_a_new_round_not_a_restart():
    state = State(phase=Phase.RUNNING)
    state, actions = step(state, ranks(running(0)), Events(now=1.0, other_node_said=True))
    assert actions == (Collect(Verdict.OTHER_NODE),)
    joined = ended(False, 0, 0, membership=True)
    state, actions = step(state, ranks(), Events(now=2.0, ended=joined))
    assert (state.phase, state.attempt, state.rounds) == (Phase.RESTARTING, 0, 1)
    assert actions == (Restart(new_round=True),)


def test_a_rank_stuck_after_its_error_fails_the_job_like_one_that_exited():
    stuck = running(1, error=error("boom"), error_written=990.0)
    state, _ = step(State(phase=Phase.RUNNING), ranks(running(0), stuck), Events(now=1.0))
    assert (state.phase, state.verdict) == (Phase.SETTLING, Verdict.RANK_FAILED)


def test_ranks_that_failed_waiting_for_a_peer_wait_for_another_nodes_word_then_take_it():
    # several nodes: rank 1 failed because a peer on another node went away; that node's loss
    # is seen a few seconds later (--node-timeout) and is the cause, not rank 1
    victim = ranks(running(0), exited(1, 1, error=error("Connection closed by peer")))
    settling = State(phase=Phase.SETTLING, since=0.0, verdict=Verdict.RANK_FAILED)
    state, actions = step(settling, victim, Events(now=SETTLE + SETTLE_WAITING + 1, peer_wait=5))
    assert (state.phase, actions) == (Phase.SETTLING, ())
    state, actions = step(state, victim, Events(now=4.0, node_lost=True, peer_wait=5))
    assert (state.phase, actions) == (Phase.STOPPING, (Collect(Verdict.NODE_LOST),))
    state, actions = step(settling, victim, Events(now=4.0, other_node_said=True, peer_wait=5))
    assert actions == (Collect(Verdict.OTHER_NODE),)
    # no word within the wait: the failure is this node's
    state, actions = step(settling, victim, Events(now=5.1, peer_wait=5))
    assert actions == (Collect(Verdict.RANK_FAILED),)


def test_a_rank_that_failed_for_itself_does_not_wait_for_another_nodes_word():
    crashed = ranks(running(0), exited(1, 1, error=error("boom")))
    settling = State(phase=Phase.SETTLING, since=0.0, verdict=Verdict.RANK_FAILED)
    state, actions = step(settling, crashed, Events(now=SETTLE + 0.01, node_lost=True, peer_wait=5))
    assert actions == (Collect(Verdict.RANK_FAILED),)
