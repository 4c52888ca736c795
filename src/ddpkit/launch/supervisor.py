"""`ddpkit run`'s edge: the I/O around the job's step function (ddpkit.launch.lifecycle).

Each poll the supervisor reaps the workers that exited, looks at every rank once (a
`snapshot.Snapshot`), gathers the events (a stop signal, a closed console, another node's word,
the hang watch's findings), asks `lifecycle.step` for the next state and the actions, and
performs them:

    Start         the workers start, each in a session of its own, each told to the watchdog
    Watch         the watches' notes are said, the speed doctor samples, a pause
    AnswerPlaces  node 0 asks where this node's ranks are
    DescribeWait  ranks that wait long for a working one are said once (not a hang)
    Collect       the verdict's outcome with its evidence (ddpkit.launch.outcomes' table);
                  every process of the attempt ends (the signal forwarded, the grace,
                  SIGKILL); the report is written
    Restart       the nodes meet again (a restart, or a new round of membership)
    Finish        the job's end: done, or the report

Every wait goes through one primitive (`wait.Wait`: a deadline that also gives up on a stop
signal); the other nodes are a `Peers` (`NoPeers` for one node), so nothing here asks how many
nodes there are. Promises: every worker is tied to the launcher by a death signal and watched
by a watchdog process that ends the job if the launcher is SIGKILLed; on a failure, Ctrl+C or
SIGTERM, a rank missing at init or a lost node, every process of the job gets SIGTERM, then
SIGKILL after the grace; a second Ctrl+C kills at once. The exit code is the root-cause rank's
(128+N for signal N), 130/143 after Ctrl+C/SIGTERM, 124 for a hang, and 1 for failures the
launcher found itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.errors import debug_enabled
from ddpkit.launch import (
    lifecycle,
    outcomes,
    profile_breakdown,
    recovery,
    report,
    rescuing,
    spares,
    watchdog,
)
from ddpkit.launch.base import rundir
from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.decide import Attempt, Next, Verdict, after_attempt
from ddpkit.launch.base.output import CONSOLE
from ddpkit.launch.base.snapshot import Reader, Snapshot
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.base.worker import Signals, Worker
from ddpkit.launch.diagnosis import HANG_EXIT_CODE
from ddpkit.launch.hang import across_nodes, places, watching
from ddpkit.launch.hang.progress_watch import Waits, Watch
from ddpkit.launch.lifecycle import Events, Phase, State
from ddpkit.launch.peers import crossnode, profile_relay
from ddpkit.launch.peers.liveness import Abort
from ddpkit.launch.peers.nodes import NodeGroup
from ddpkit.launch.peers.peers import Peers, peers_of
from ddpkit.launch.peers.profile_relay import PlansChannel
from ddpkit.launch.peers.rounds import join
from ddpkit.launch.spares import Spares
from ddpkit.launch.speed.across_nodes import SummariesChannel
from ddpkit.launch.speed.step_watch import SpeedWatch
from ddpkit.launch.workers import (
    FORWARDED,
    QUIETED,
    end_orphans,
    start_worker,
    stop_workers,
    worker_env,
)

PR_SET_CHILD_SUBREAPER = 36
# a peer's failure: the ranks left write the last completed step before they are stopped
RESCUED_AFTER = (Verdict.RANK_FAILED, Verdict.NODE_LOST, Verdict.OTHER_NODE)
SPARES_AFTER = 10.0  # seconds every rank is ready before spares start without a rank's imports
log = logging.getLogger(__name__)


@dataclass
class Job:
    """What lives for the whole job, across attempts and rounds."""

    cfg: LaunchConfig
    run_dir: Path
    signals: Signals
    watchdog: subprocess.Popen[bytes]
    node: NodeGroup
    began: float = field(default_factory=time.monotonic)
    running: Running | None = None  # the attempt whose workers may be running
    failure: recovery.Failure | None = None  # the last restart's, until its cost is said
    spares: Spares = field(default_factory=Spares)  # warm spares of the next attempt

    @property
    def wait(self) -> Wait:
        return Wait(self.signals.reason)


@dataclass
class Running:
    """One attempt as the edge holds it: its ranks and its watches."""

    scene: outcomes.Scene
    state_dir: Path
    hangs: Watch
    speed: SpeedWatch
    outcome: report.Outcome | None = None
    notes: list[str] = field(default_factory=list)  # the hang watch's, to be said
    waits: Waits | None = None  # a long wait the hang watch found, to be described
    ended: Snapshot | None = None  # the ranks as they ended
    begun: tuple[int, int] = (0, 0)  # (attempt, rounds) of its Start
    profile_looked: float = 0.0  # monotonic time --profile-steps' recording was last looked for

    @property
    def workers(self) -> list[Worker]:
        return self.scene.workers


def launch(cfg: LaunchConfig) -> int:
    """Run the job described by `cfg`; return the exit code for `ddpkit run`."""
    return launch_job(cfg).exit_code


def launch_job(cfg: LaunchConfig) -> report.Ended:
    """Run the job described by `cfg`; how it ended."""
    _prepare(cfg)
    base = rundir.base_folder(cfg.log_dir)  # bad --log-dir: an error before anything starts
    node = join(cfg)  # meet, before our handlers: Ctrl+C while waiting for nodes just stops
    signals = Signals()
    previous = {s: signal.signal(s, signals.handle) for s in {*FORWARDED, *cfg.torchrun.signals}}
    guard = None
    job: Job | None = None
    try:
        name = node.run_id if node.nnodes == 1 else f"{node.run_id}-node{node.group_rank}"
        run_dir = rundir.make(base, name)
        rundir.mark_latest(base, run_dir)
        with contextlib.suppress(OSError):
            gone = rundir.prune(base)
            if gone:
                _say(
                    f"removed {len(gone)} old run folder(s) from {base}, keeping the newest "
                    f"{rundir.keep_runs()} (DDPKIT_KEEP_RUNS sets how many)"
                )
        _say_start(cfg, node, run_dir)
        guard = watchdog.start(node.run_id, cfg.grace)
        job = Job(cfg, run_dir, signals, guard, node)
        code = drive(job)
        return report.Ended(code, run_dir, job.running.outcome if job.running else None)
    finally:
        (job.node if job is not None else node).close()
        if guard is not None:
            watchdog.finish(guard)
        for s, handler in previous.items():
            signal.signal(s, handler)


def drive(job: Job) -> int:
    """Step the job from STARTING to DONE, performing each step's actions; the exit code."""
    state = State()
    try:
        while state.phase is not Phase.DONE:
            state = _step(job, state)
    finally:
        if job.running is not None and job.running.outcome is None:  # an error while it ran
            _stop(job, job.running)
        job.spares.end()
    outcome = job.running.outcome if job.running is not None else None
    return outcome.exit_code if outcome is not None else 1


def _step(job: Job, state: State) -> State:
    """One look, one step, its actions performed."""
    running = job.running
    snap, events = _look(job, running, state)
    before = state.phase
    state, actions = lifecycle.step(state, snap, events)
    if state.phase is not before:
        why = f" ({state.verdict.value})" if state.verdict is not None else ""
        log.debug("%s -> %s%s", before.value, state.phase.value, why)
    for action in actions:
        if not isinstance(action, lifecycle.Watch):  # the job goes on: every poll
            log.debug("action: %s", action)
        if isinstance(action, lifecycle.Start):
            running = _start(job, action)  # job.running from here
        elif isinstance(action, lifecycle.Collect):
            assert running is not None
            running.outcome = _collect_and_stop(job, running, action.verdict, state.attempt)
        elif isinstance(action, lifecycle.Restart):
            assert running is not None
            _say_restart(job, running, action.new_round, state.attempt)
            if running.ended is not None and not action.new_round:
                tries = f"attempt {state.attempt + 1} of {job.cfg.max_restarts + 1}"
                assert running.outcome is not None
                job.failure = recovery.failure_of(running.outcome, running.ended, tries)
            had = job.node.nnodes
            job.node = crossnode.next_round(job.cfg, job.node)  # meet again
            if job.node.nnodes != had:
                world = job.node.nnodes * job.cfg.nproc_per_node
                _say(f"continuing on {job.node.nnodes} node(s), world size {world} "
                     f"(was {had} node(s), {had * job.cfg.nproc_per_node})")  # fmt: skip
            job.running = None  # stopped and said: the next attempt starts bare
        elif isinstance(action, lifecycle.Finish):
            assert running is not None
            _say_end(job, running)
        elif running is not None:
            _act(job, running, action, snap)
    return state


def _look(job: Job, running: Running | None, state: State) -> tuple[Snapshot, Events]:
    """One look at the ranks and at what else happened, for the step function."""
    now = time.monotonic()
    signal_ = job.signals.last if job.signals.count else None
    if running is None:
        return Snapshot(()), Events(now=now, signal=signal_)
    if state.phase is Phase.STOPPING:  # the attempt has ended: how, for after_attempt
        outcome = running.outcome
        assert outcome is not None
        ended = Attempt(
            ok=outcome.ok,
            restartable=outcome.restartable,
            membership=outcome.membership,
            signalled=job.signals.count > 0,
            attempt=state.attempt,
            max_restarts=job.cfg.max_restarts,
        )
        return Snapshot(()), Events(now=now, signal=signal_, ended=ended)
    snap = running.scene.look(steps=None, usage=None)
    peers = running.scene.peers
    watching = state.phase is Phase.RUNNING
    hung = watching and _watch_hangs(running, snap)
    return snap, Events(
        now=now,
        signal=signal_,
        console_closed=CONSOLE.closed is not None,
        other_node_said=peers.word() is not None,
        node_lost=peers.lost() is not None,
        hung=hung,
        init_timeout=job.cfg.init_timeout,
        peer_wait=job.cfg.node_timeout + 1.0 if job.node.multi_node else 0.0,
        hang_asked=watching and across_nodes.asked(peers),
        long_wait=running.waits is not None,
    )


def _watch_hangs(running: Running, snap: Snapshot) -> bool:
    """The hang watch's look (ddpkit.launch.hang.watching); whether the job hangs."""
    peers = running.scene.peers
    running.hangs, found = watching.look(running.hangs, snap, running.state_dir, peers)
    running.notes.extend(found.notes)
    running.waits = found.waits or running.waits
    if found.hung:
        running.scene.stall, running.scene.window = found.stall, found.window
    return found.hung


def _start(job: Job, action: lifecycle.Start) -> Running:
    """Start every worker of this node (none more once a stop signal came), and the watches."""
    cfg, node = job.cfg, job.node
    state_dir = job.run_dir / f"state{action.rounds}"
    state_dir.mkdir(mode=0o700)
    elastic = cfg.min_nodes < cfg.nnodes
    restarts_left = cfg.max_restarts - action.attempt
    channels = (across_nodes.PlacesChannel(node), SummariesChannel(node), PlansChannel())
    peers = peers_of(
        node, cfg.node_timeout, elastic, cfg.min_nodes * elastic, restarts_left, channels
    )
    peers.start()
    workers: list[Worker] = []
    speed = SpeedWatch(job.run_dir, cfg.straggler_threshold, cfg.straggler_window, node.host, peers)
    scene = outcomes.Scene(
        cfg, job.signals, workers, Reader(state_dir), peers, speed.memory.growth, speed.take
    )
    running = Running(scene, state_dir, Watch(cfg.hang_timeout, cfg.hang_min), speed)
    running.begun = (action.attempt, action.rounds)
    job.running = running  # stopped by drive() should anything below raise
    for local_rank in range(cfg.nproc_per_node):
        if job.signals.count:  # Ctrl+C or SIGTERM while starting: start no more
            break
        rank = node.group_rank * cfg.nproc_per_node + local_rank
        env = worker_env(cfg, node, rank, local_rank, action.attempt, state_dir)
        warm = job.spares.take(cfg, rank, env, job.run_dir, running.begun)
        workers.append(warm or start_worker(cfg, rank, env, job.run_dir))
        watchdog.tell(job.watchdog, f"group {workers[-1].pgid}")
        log.debug("rank %d started%s: pid %d", rank, " warm" * bool(warm), workers[-1].proc.pid)
    job.spares.end()  # any not taken (a new round moved the ranks)
    speed.watch({w.rank: w.proc.pid for w in workers})
    log.debug("attempt %d: %d worker(s) in %s", action.attempt, len(workers), state_dir)
    if cfg.kind == "command" and not job.signals.count:
        # a program, not Python: its rank 0 cannot serve the store
        node.serve_store(cfg.init_timeout, job.wait)  # the workers' connections wait till now
    return running


def _act(job: Job, running: Running, action: lifecycle.Action, snap: Snapshot) -> None:
    """The actions of a job that goes on."""
    if isinstance(action, lifecycle.AnswerPlaces):  # node 0 asks where this node's ranks are
        across_nodes.answer(running.scene.peers, *places.collect(snap, wait=job.wait))
    elif isinstance(action, lifecycle.DescribeWait):
        waits, running.waits = running.waits, None
        if waits is not None:
            _say(places.long_wait_note(snap, waits.waiting, waits.working, waits.began, job.wait))
    elif isinstance(action, lifecycle.Watch):
        _make_spares(job, running, snap)
        if job.failure is not None:  # a restarted job: what the failure cost, once it steps
            line = recovery.went_on(job.failure, snap)
            if line is not None:
                job.failure = None
                _say(line)
        while running.notes:
            _say(running.notes.pop(0))
        _say_profile(job, running, at_end=False)
        pids = {w.rank: w.proc.pid for w in running.workers}
        profile_relay.take(job.run_dir, job.node, running.scene.peers, running.state_dir, pids)
        running.speed.sample(snap)
        while running.speed.notes:
            _say(running.speed.notes.pop(0))
        time.sleep(job.cfg.torchrun.monitor_interval)


def _make_spares(job: Job, running: Running, snap: Snapshot) -> None:
    """Once a rank of the attempt listed its imports at its first step (or every rank has been
    ready for a while: a job without optimizer steps) and a restart can still come: the next
    attempt's warm spares (ddpkit.launch.spares)."""
    attempt, rounds = running.begun
    nxt = (attempt + 1, rounds + 1)
    if job.spares.for_start == nxt or not spares.wanted(job.cfg, attempt) or job.signals.count:
        return
    if not snap.ranks or any(v.phase != "ready" or not v.alive for v in snap.ranks):
        return
    listed = protocol.state_path(running.state_dir, snap.ranks[0].rank, protocol.MODULES)
    if not listed.exists() and snap.wall - max(v.phase_since for v in snap.ranks) < SPARES_AFTER:
        return
    cfg, node = job.cfg, job.node
    state_dir = job.run_dir / f"state{nxt[1]}"
    envs = {}
    for local_rank in range(cfg.nproc_per_node):
        rank = node.group_rank * cfg.nproc_per_node + local_rank
        envs[rank] = worker_env(cfg, node, rank, local_rank, nxt[0], state_dir)
    for group in job.spares.start(cfg, envs, nxt, listed if listed.exists() else None):
        watchdog.tell(job.watchdog, f"group {group}")
    log.debug("spares for attempt %d: %s", nxt[0], sorted(job.spares.pids))


def _collect_and_stop(job: Job, running: Running, verdict: Verdict, attempt: int) -> report.Outcome:
    """The verdict's outcome (its collector), then every process of the attempt ended, the
    speed doctor's summary, and the report."""
    cfg, node, scene = job.cfg, job.node, running.scene
    workers = running.workers
    try:
        outcome = outcomes.COLLECTORS[verdict](scene)
        log.debug("outcome of %s: %s", verdict.value, outcome.summary)
        if scene.peers.multi_node and outcome.from_node is None and not outcome.ok:
            # this node knows why: the others stop for the same reason, before this node's
            # ranks go and theirs fail for want of a peer
            why = f"node {node.group_rank} ({node.host}): {outcome.summary}"
            others = outcome.exit_code if outcome.exit_code == HANG_EXIT_CODE else 1
            restart = after_attempt(
                Attempt(False, outcome.restartable, False, job.signals.count > 0, attempt,
                        cfg.max_restarts)
            ) is Next.RESTART  # fmt: skip
            scene.peers.publish_abort(
                Abort(node.group_rank, why, others, restart), job.signals.count > 0
            )
        if verdict in RESCUED_AFTER and not job.signals.count:
            # the ranks left may be blocked on the lost one for good: they write first
            rescuing.ask_survivors(workers, scene.look(), running.state_dir, job.wait)
    finally:
        given = _stop(job, running)
    speed = running.speed
    ended = scene.reader.look(workers, steps=True, usage=False)  # the ranks as they ended
    running.ended = ended
    if not job.signals.count:
        summary = speed.finish(ended)  # speed.json and steps.png, whatever the outcome
        while speed.notes:
            _say(speed.notes.pop(0))
        if summary and outcome.ok:  # after a failure the step times are beside the point
            _say(summary)
    return outcome.finalize(workers, ended, job.run_dir, outcomes.script_roots(cfg), given)


def _stop(job: Job, running: Running) -> float:
    """Every process of the attempt ends; the grace the ranks were given."""
    workers = running.workers
    # the ranks that read s.stop_requested save before they leave: a longer grace for them
    seen = running.scene.reader.look(workers, steps=False, usage=False)
    graceful = {v.rank for v in seen.ranks if v.graceful}
    keep = frozenset(job.spares.pids)
    given = stop_workers(workers, job.cfg.grace, job.signals, job.node.run_id, graceful, keep)
    for w in workers:
        w.output.close()
    end_orphans({w.proc.pid for w in workers} | keep, job.watchdog.pid)
    return given


def _say_profile(job: Job, running: Running, at_end: bool) -> None:
    """--profile-steps: once every rank of this node has written its recording (or at the
    job's end, what was written), where each step went."""
    steps = job.cfg.profile_steps
    now = time.monotonic()
    if steps is None or running.begun[0] != 0 or (not at_end and now - running.profile_looked < 1):
        return
    running.profile_looked = now
    ranks = [w.rank for w in running.workers]
    said = profile_breakdown.once_written(
        job.run_dir, steps, ranks, running.scene.reader.timed_steps, at_end
    )
    if said is not None:
        _say(said)


def _say_end(job: Job, running: Running) -> None:
    """The job's last word: done, or its report."""
    peers, outcome = running.scene.peers, running.outcome
    assert outcome is not None
    _say_profile(job, running, at_end=True)
    if debug_enabled() and peers.debug_line():
        _say(peers.debug_line())
    if outcome.ok:
        peers.finish()
        _say(_done_line(job.run_dir, time.monotonic() - job.began))
        return
    _leave(job, peers)
    _say(outcome.text.lstrip("\n"), prefix="")


def _say_restart(job: Job, running: Running, new_round: bool, attempt: int) -> None:
    """A restart (attempt N of M: the failure's report, then the group starts again) or a new
    round of membership, said before the nodes meet again."""
    outcome = running.outcome
    assert outcome is not None
    if debug_enabled() and running.scene.peers.debug_line():
        _say(running.scene.peers.debug_line())
    _leave(job, running.scene.peers)
    if new_round:
        _say(f"the job's nodes change ({outcome.summary}): every node starts again")
        return
    tries = f"attempt {attempt} of {job.cfg.max_restarts + 1}"
    _say(outcome.render(attempt=tries).lstrip("\n"), prefix="")
    _say(f"restarting the whole group ({attempt} of {job.cfg.max_restarts})")


def _leave(job: Job, peers: Peers) -> None:
    """This node is done with the round: a node that serves a store waits for the others to
    read why (bounded)."""
    hurry = job.signals.count > 0
    peers.leave(1.0 if hurry else job.cfg.node_timeout, hurry)


def _prepare(cfg: LaunchConfig) -> None:
    _become_subreaper()
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # torch's C++ warnings about the launchers' own store connections (a node gone, a
        # reverse lookup) are noise: ddpkit says what happened. The workers keep torch's level.
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        os.environ[QUIETED] = "1"
    if cfg.multi_node:
        meet = cfg.rdzv or f"{cfg.master_addr}:{cfg.master_port}"
        _say(f"waiting up to {cfg.init_timeout:g} s for {cfg.nnodes} nodes to meet at {meet}")


def _done_line(run_dir: Path, seconds: float) -> str:
    files = [name for name in ("speed.json", "steps.png") if (run_dir / name).exists()]
    also = f" ({', '.join(files)} beside the logs)" if files else ""
    return f"done in {seconds:.1f} s: every rank exited 0; logs in {run_dir}{also}"


def _say_start(cfg: LaunchConfig, node: NodeGroup, run_dir: Path) -> None:
    world = cfg.nproc_per_node * node.nnodes
    backend = {"gloo": "gloo on CPU", "nccl": "nccl"}.get(cfg.backend, "auto backend")
    where = ""
    if node.multi_node:
        where = (
            f" (node {node.group_rank} of {node.nnodes}, {node.host}; store at "
            f"{node.master_addr}:{node.master_port})"
        )
    _say(
        f"run {node.run_id}: {cfg.nproc_per_node} process(es) on this node{where}, "
        f"world size {world}, {backend}; logs in {run_dir}"
    )


def _become_subreaper() -> None:
    """Orphans of our workers re-parent to the launcher (not init), so none escapes notice."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _say(text: str, prefix: str = "ddpkit: ") -> None:
    CONSOLE.say(f"{prefix}{text}")
