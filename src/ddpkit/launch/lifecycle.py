"""The job as a state value and one step function: (state, snapshot, events) -> (state, actions).

    STARTING --Start--> RUNNING --(a rank failed)--> SETTLING --(landed)--> STOPPING --Collect
                           |                                                   ^
                           +--(a signal, a hang, a lost node, success...)------+
    STOPPING --(the attempt ended)--> RESTARTING --Restart, then Start--> RUNNING
                                 \\--> DONE --Finish       (--max-restarts, a new round)

`step` does no I/O and reads no clock: the supervisor (the edge) looks at the ranks (a
`snapshot.Snapshot`), gathers what else happened (`Events`: a stop signal, another node's word,
the watches' findings, how a stopped attempt ended), calls `step`, and performs the actions it
returns (for `Collect(verdict)` the edge's table of collectors, ddpkit.launch.outcomes,
gathers the evidence the verdict's report needs). Tests drive whole episodes (a failure then a
restart, a hang during a stop) with made-up snapshots, as torch elastic's agent tests do
(tests/unit/test_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from ddpkit.launch import observe
from ddpkit.launch.base.decide import Attempt, Next, Observation, Verdict, after_attempt, decide
from ddpkit.launch.base.snapshot import ERROR_EXIT_WAIT, Snapshot

SETTLE = 0.2  # seconds near-simultaneous exits get to land before the root cause is chosen
# at most this long more for the ranks that are failing the same way as the first
SETTLE_WAITING = ERROR_EXIT_WAIT
INIT_CHECK_EVERY = 0.5  # seconds between checks for ranks missing at init


class Phase(Enum):
    STARTING = "starting"  # the workers of an attempt are to be started
    RUNNING = "running"  # the job is watched: look, decide, act
    SETTLING = "settling"  # a rank failed: near-simultaneous exits land before the report
    STOPPING = "stopping"  # the verdict is in: evidence collected, every process ended
    RESTARTING = "restarting"  # a restart or a new round of membership: meet again
    DONE = "done"  # the job's end: the exit code is the attempt's


@dataclass(frozen=True)
class State:
    phase: Phase = Phase.STARTING
    since: float = 0.0  # monotonic time the phase began
    verdict: Verdict | None = None  # why the job is settling or stopping
    attempt: int = 0  # restarts so far (--max-restarts)
    rounds: int = 0  # attempts and rounds so far (each has its own state folder)
    next_init_check: float = 0.0  # monotonic time of the next check for ranks missing at init


@dataclass(frozen=True)
class Events:
    """What happened besides the ranks' snapshot, as plain data."""

    now: float = 0.0  # monotonic
    signal: int | None = None  # the last stop signal the launcher got
    console_closed: bool = False  # the reader of the launcher's output went away
    other_node_said: bool = False  # another node stopped the job (or nodes join)
    node_lost: bool = False
    hung: bool = False  # the hang watch: no rank made progress for --hang-timeout
    init_timeout: float = 0.0  # --init-timeout (the check of ranks missing at init)
    hang_asked: bool = False  # node 0 asks where this node's ranks are
    long_wait: bool = False  # the hang watch found ranks waiting long for a working one
    ended: Attempt | None = None  # how the stopped attempt ended (in STOPPING)
    # several nodes: how long ranks that failed waiting for a peer wait for another node's word
    # (a lost node, an abort) before their failure is taken as this node's own
    peer_wait: float = 0.0


# -- actions: what the edge does ----------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """Start this node's workers for attempt `attempt` in state folder `rounds`."""

    attempt: int
    rounds: int


@dataclass(frozen=True)
class Watch:
    """The job goes on: the watches' notes said, the speed doctor sampled, then a pause."""


@dataclass(frozen=True)
class AnswerPlaces:
    """Node 0 asked where this node's ranks are: collect their places and answer."""


@dataclass(frozen=True)
class DescribeWait:
    """Say, once, who has waited long for whom (not a hang)."""


@dataclass(frozen=True)
class Collect:
    """Gather the outcome of `verdict` with the evidence its report needs
    (ddpkit.launch.outcomes), then stop every process of the attempt and write the report."""

    verdict: Verdict


@dataclass(frozen=True)
class Restart:
    """Meet the other nodes again: `new_round` for a change of membership, else a restart of
    the whole group after a failure (--max-restarts)."""

    new_round: bool


@dataclass(frozen=True)
class Finish:
    """The job ends with the last attempt's exit code."""


Action = Start | Watch | AnswerPlaces | DescribeWait | Collect | Restart | Finish


def step(state: State, snap: Snapshot, events: Events) -> tuple[State, tuple[Action, ...]]:
    """The next state and what to do, from the state, one look at the ranks and the events."""
    now = events.now
    if state.phase in (Phase.STARTING, Phase.RESTARTING):
        started = replace(state, phase=Phase.RUNNING, since=now, verdict=None)
        return started, (Start(state.attempt, state.rounds),)
    if state.phase is Phase.RUNNING:
        checking_init = now >= state.next_init_check
        if checking_init:
            state = replace(state, next_init_check=now + INIT_CHECK_EVERY)
        verdict = decide(
            Observation(
                signal=events.signal,
                failed=observe.failed(snap),
                running=tuple(v.rank for v in snap.running),
                console_closed=events.console_closed,
                other_node_said=events.other_node_said,
                node_lost=events.node_lost,
                hung=events.hung,
                missing_at_init=checking_init
                and observe.missing_at_init(snap, events.init_timeout) is not None,
            )
        )
        if verdict is Verdict.GO_ON:
            actions: list[Action] = []
            if events.hang_asked:
                actions.append(AnswerPlaces())
            if events.long_wait:
                actions.append(DescribeWait())
            actions.append(Watch())
            return state, tuple(actions)
        if verdict is Verdict.RANK_FAILED:
            return replace(state, phase=Phase.SETTLING, since=now, verdict=verdict), ()
        return _stopping(state, verdict, now)
    if state.phase is Phase.SETTLING:
        waited = now - state.since
        landed = waited >= SETTLE and (observe.settled(snap) or waited >= SETTLE + SETTLE_WAITING)
        if events.signal is None and observe.only_victims(snap):
            # the peer they waited for may be on another node: its word names the cause
            if events.other_node_said:
                return _stopping(state, Verdict.OTHER_NODE, now)
            if events.node_lost:
                return _stopping(state, Verdict.NODE_LOST, now)
            landed = landed and waited >= events.peer_wait
        if events.signal is not None or landed:  # a stop signal cuts the settling short
            return _stopping(state, Verdict.RANK_FAILED, now)
        return state, ()
    if state.phase is Phase.STOPPING:
        if events.ended is None:
            return state, ()
        then = after_attempt(events.ended)
        if then is Next.DONE:
            return replace(state, phase=Phase.DONE, since=now), (Finish(),)
        restart = replace(state, phase=Phase.RESTARTING, since=now, rounds=state.rounds + 1)
        if then is Next.RESTART:
            restart = replace(restart, attempt=state.attempt + 1)
        return restart, (Restart(new_round=then is Next.NEW_ROUND),)
    return state, ()


def _stopping(state: State, verdict: Verdict, now: float) -> tuple[State, tuple[Action, ...]]:
    return replace(state, phase=Phase.STOPPING, since=now, verdict=verdict), (Collect(verdict),)
