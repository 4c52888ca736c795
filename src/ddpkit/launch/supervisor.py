"""`ddpkit run` as one state machine: start the workers, watch them, stop them all.

The phases of an attempt, one handler each:

    meet     the nodes meet (one node: nothing to do); a restart or a new round meets again
    start    the workers start, each in a session of its own, each told to the watchdog
    run      look at the job (`observe`), ask what it means (`decide.decide`), act on it,
             until the verdict is not "go on"
    settle   after a failure, near-simultaneous exits land, so the root cause is chosen
             among them
    collect  the evidence the report needs: stacks in a hang, the rank the others waited
             for, another node's word on why
    stop     every process of the job ends (the signal forwarded, the grace, SIGKILL)
    report   the outcome, written and printed
    leave    this node is done with the round; then `decide.after_attempt` says: restart
             (meet again), a new round of membership, or done.

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
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ddpkit.errors import debug_enabled
from ddpkit.launch import causes, observe, report, rundir, watchdog
from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.decide import Attempt, Next, Observation, Verdict, after_attempt, decide
from ddpkit.launch.hang import blame, mismatch, places
from ddpkit.launch.hang.watch import HANG_EXIT_CODE, HangWatch
from ddpkit.launch.output import CONSOLE
from ddpkit.launch.peers import crossnode
from ddpkit.launch.peers.liveness import BEAT, Abort
from ddpkit.launch.peers.nodes import NodeGroup, join
from ddpkit.launch.peers.peers import Peers, peers_of, wait_for_word
from ddpkit.launch.speed.watch import SpeedWatch
from ddpkit.launch.wait import Wait
from ddpkit.launch.workers import (
    FORWARDED,
    QUIETED,
    Signals,
    Worker,
    end_orphans,
    start_worker,
    stop_workers,
    worker_env,
)

PR_SET_CHILD_SUBREAPER = 36
SETTLE = 0.2  # seconds near-simultaneous exits get to land before the root cause is chosen
# at most this long for the ranks that are failing the same way as the first (observe.settled)
SETTLE_WAITING = observe.ERROR_EXIT_WAIT
INIT_CHECK_EVERY = 0.5


@dataclass
class Job:
    """What lives for the whole job, across attempts and rounds."""

    cfg: LaunchConfig
    run_dir: Path
    signals: Signals
    watchdog: subprocess.Popen[bytes]

    def interrupted(self) -> str | None:
        """Why to give up a wait: a stop signal the launcher got."""
        return signal.Signals(self.signals.last).name if self.signals.count else None

    @property
    def wait(self) -> Wait:
        return Wait(self.interrupted)


def launch(cfg: LaunchConfig) -> int:
    """Run the job described by `cfg`; return the exit code for `ddpkit run`."""
    _prepare(cfg)
    base = rundir.base_folder(cfg.log_dir)  # bad --log-dir: an error before anything starts
    node = join(cfg)  # meet, before our handlers: Ctrl+C while waiting for nodes just stops
    signals = Signals()
    previous = {s: signal.signal(s, signals.handle) for s in {*FORWARDED, *cfg.torchrun.signals}}
    guard = None
    code = 1
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
        job = Job(cfg, run_dir, signals, guard)
        attempt, rounds, began = 0, 0, time.monotonic()
        while True:
            peers = peers_of(node, cfg.node_timeout, elastic=cfg.min_nodes < cfg.nnodes)
            peers.start()
            outcome = run_attempt(job, node, peers, run_dir / f"state{rounds}", attempt)
            code, rounds = outcome.exit_code, rounds + 1
            if debug_enabled() and peers.debug_line():
                _say(peers.debug_line())
            then = after_attempt(
                Attempt(
                    ok=outcome.ok,
                    restartable=outcome.restartable,
                    membership=outcome.membership,
                    signalled=signals.count > 0,
                    attempt=attempt,
                    max_restarts=cfg.max_restarts,
                )
            )
            # leave: a node that serves a store waits for the others to read why (bounded)
            if outcome.ok:
                peers.finish()
                _say(_done_line(run_dir, time.monotonic() - began))
                break
            hurry = signals.count > 0
            peers.leave(1.0 if hurry else cfg.node_timeout, hurry)
            if then is Next.DONE:
                _say(outcome.text.lstrip("\n"), prefix="")
                break
            if then is Next.NEW_ROUND:
                _say(f"the job's nodes change ({outcome.summary}): every node starts again")
            else:  # not the job's end: no exit code yet, the group starts again
                text = outcome.text.lstrip("\n").rsplit("\n  exit code:", 1)[0]
                tries = f"attempt {attempt + 1} of {cfg.max_restarts + 1}"
                _say(text.replace("ddpkit: the job ", f"ddpkit: {tries}: the job ", 1), prefix="")
                attempt += 1
                _say(f"restarting the whole group ({attempt} of {cfg.max_restarts})")
            node = crossnode.next_round(cfg, node)  # meet again
    finally:
        node.close()
        if guard is not None:
            watchdog.finish(guard)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code


def run_attempt(
    job: Job, node: NodeGroup, peers: Peers, state_dir: Path, attempt: int
) -> report.Outcome:
    """One attempt: start, run, settle, collect, stop, report. Returns the finalized outcome."""
    cfg = job.cfg
    state_dir.mkdir(mode=0o700)
    workers: list[Worker] = []
    speed = None
    given = cfg.grace
    try:
        _start(job, node, state_dir, attempt, workers)
        speed = SpeedWatch(
            workers,
            state_dir,
            job.run_dir,
            cfg.straggler_threshold,
            cfg.straggler_window,
            node.host,
            peers,
        )
        verdict, stall = _run(job, workers, state_dir, peers, speed)
        outcome = _collect(job, verdict, stall, workers, state_dir, peers, speed)
        if peers.multi_node and outcome.from_node is None and not outcome.ok:
            # this node knows why: the others stop for the same reason, before this node's
            # ranks go and theirs fail for want of a peer
            why = f"node {node.group_rank} ({node.host}): {outcome.summary}"
            others = outcome.exit_code if outcome.exit_code == HANG_EXIT_CODE else 1
            restart = after_attempt(
                Attempt(False, outcome.restartable, False, job.signals.count > 0, attempt,
                        cfg.max_restarts)
            ) is Next.RESTART  # fmt: skip
            peers.publish_abort(Abort(node.group_rank, why, others, restart), job.signals.count > 0)
    finally:
        # stop
        given = stop_workers(workers, cfg.grace, job.signals, node.run_id, state_dir)
        for w in workers:
            w.output.close()
        end_orphans({w.proc.pid for w in workers}, job.watchdog.pid)
    if speed is not None and not job.signals.count:
        summary = speed.finish()  # speed.json and steps.png, whatever the outcome
        while speed.notes:
            _say(speed.notes.pop(0))
        if summary and outcome.ok:  # after a failure the step times are beside the point
            _say(summary)
    # report
    outcome.grace = given
    outcome.finalize(workers, job.run_dir, state_dir, script_roots(cfg))
    return outcome


def _start(job: Job, node: NodeGroup, state_dir: Path, attempt: int, workers: list[Worker]) -> None:
    """Start every worker of this node (none more once a stop signal came)."""
    cfg = job.cfg
    for local_rank in range(cfg.nproc_per_node):
        if job.signals.count:  # Ctrl+C or SIGTERM while starting: start no more
            return
        rank = node.group_rank * cfg.nproc_per_node + local_rank
        env = worker_env(cfg, node, rank, local_rank, attempt, state_dir)
        workers.append(start_worker(cfg, rank, env, job.run_dir))
        watchdog.tell(job.watchdog, f"group {workers[-1].pgid}")
    if cfg.kind == "command":  # a program, not Python: its rank 0 cannot serve the store
        node.serve_store(cfg.init_timeout, job.wait)  # the workers' connections wait till now


def _run(
    job: Job, workers: list[Worker], state_dir: Path, peers: Peers, speed: SpeedWatch
) -> tuple[Verdict, float]:
    """Look, decide, act, until the verdict is not GO_ON; (the verdict, how long no rank made
    progress). What the job goes on with is acted on here: the watches' notes, a long wait
    said, another node's question answered."""
    cfg = job.cfg
    hangs = HangWatch(workers, state_dir, cfg.hang_timeout, peers)
    next_init_check = 0.0
    while True:
        now = time.monotonic()
        observe.reap(workers)
        checking_init = now >= next_init_check
        if checking_init:
            next_init_check = now + INIT_CHECK_EVERY
        seen = Observation(
            signal=job.signals.last if job.signals.count else None,
            failed=tuple(w.rank for w in observe.failed(workers, state_dir)),
            running=tuple(w.rank for w in workers if w.exit_code is None),
            console_closed=CONSOLE.closed is not None,
            other_node_said=peers.word() is not None,
            node_lost=peers.lost() is not None,
            hung=hangs.hung(now),
            missing_at_init=checking_init
            and observe.missing_at_init(workers, state_dir, cfg.init_timeout) is not None,
        )
        verdict = decide(seen)
        if verdict is not Verdict.GO_ON:
            return verdict, hangs.stalled_for(now)
        if peers.hang_asked():  # node 0 asks where this node's ranks are
            peers.answer_places(*places.collect(workers, state_dir, wait=job.wait))
        while hangs.notes:
            _say(hangs.notes.pop(0))
        if hangs.waits is not None:
            waits, hangs.waits = hangs.waits, None
            _say(
                places.long_wait_note(
                    workers, state_dir, waits.waiting, waits.working, waits.began, job.wait
                )
            )
        speed.sample(now)
        while speed.notes:
            _say(speed.notes.pop(0))
        time.sleep(cfg.torchrun.monitor_interval)


def _collect(
    job: Job,
    verdict: Verdict,
    stall: float,
    workers: list[Worker],
    state_dir: Path,
    peers: Peers,
    speed: SpeedWatch,
) -> report.Outcome:
    """The outcome a verdict makes, with the evidence its report needs (settle and collect)."""
    cfg, wait = job.cfg, job.wait
    if verdict is Verdict.INTERRUPTED:
        name = signal.Signals(job.signals.last).name
        return report.Outcome.interrupted_by(name, 128 + job.signals.last)
    if verdict is Verdict.RANK_FAILED:
        wait.until(lambda: False, SETTLE)  # settle: near-simultaneous exits land

        def landed() -> bool:
            observe.reap(workers)
            return observe.settled(workers, state_dir)

        wait.until(landed, SETTLE_WAITING)
        observe.reap(workers)
        outcome = report.Outcome.rank_failed(
            [w for w in workers if w.exit_code not in (None, 0)],
            state_dir,
            causes.OomWatch(),
            speed.memory.growth,
        )

        def places_of(ranks: list[int]) -> dict[int, tuple[str, str]]:
            alive = [w for w in workers if w.rank in ranks]
            return places.collect(alive, state_dir, hung=False, wait=wait)[0]

        culprit = blame.find_culprit(workers, state_dir, places_of)
        if culprit is not None:
            outcome.blame(culprit, state_dir)
        if peers.multi_node and outcome.victim:  # the cause may be another node's
            word = wait_for_word(peers, wait, cfg.node_timeout + BEAT)
            if isinstance(word, Abort):
                return report.Outcome.other_node(word)
            if isinstance(word, str):
                return report.Outcome.node_lost(word)
        return outcome
    if verdict is Verdict.CONSOLE_CLOSED:
        return report.Outcome.launcher_failure(f"{CONSOLE.closed}; the job is stopped")
    if verdict is Verdict.OTHER_NODE:
        word = peers.word()
        assert word is not None
        return report.Outcome.other_node(word)
    if verdict is Verdict.NODE_LOST:
        return report.Outcome.node_lost(peers.lost() or "a node is gone")
    if verdict is Verdict.SUCCESS:
        return report.Outcome.success()
    if verdict is Verdict.HUNG:
        return _hang_outcome(job, stall, workers, state_dir, peers)
    missing = observe.missing_at_init(workers, state_dir, cfg.init_timeout)
    outcome = report.Outcome.launcher_failure(missing or "a rank never reached init")
    # where the missing ranks are instead (or every rank, when all wait in init): their
    # stacks, as the hang doctor shows them
    absent = [w for w in workers if observe.absent(w, state_dir)] or workers
    outcome.details = places.collect(absent, state_dir, False, wait)[1]
    if not missing or missing.startswith("init_process_group did not complete"):
        outcome.fix = (
            "let ddpkit run give init its world size, rank and address (init_process_group("
            "backend) alone, or ddpkit.setup()); a script's own store or init_method='file://"
            "...' must be the same for every rank and fresh; raise --init-timeout if init is "
            "this slow at this scale"
        )
    return outcome


def _hang_outcome(
    job: Job, stall: float, workers: list[Worker], state_dir: Path, peers: Peers
) -> report.Outcome:
    """The hang report: every rank's place (every node's, from node 0). A stop signal while it
    is collected cuts its waits short, so the launcher still ends within its grace."""
    found = places.evidence(workers, state_dir, wait=job.wait)
    every, hosts, details = peers.places_everywhere(
        found.places, found.details, job.cfg.nproc_per_node, job.wait
    )
    line = f"no rank made progress for {stall:.0f} s: {places.verdict(every, hosts)}"
    if job.signals.count:
        name = signal.Signals(job.signals.last).name
        return report.Outcome.interrupted_by(name, 128 + job.signals.last)
    calls = places.calls_of(every, found.calls)
    differ = mismatch.find(calls) if calls else None
    if differ is not None:  # no timeout fixes that: say which calls differ, and where
        outcome = report.Outcome.hang(
            f"{differ.line} (no rank made progress for {stall:.0f} s)", details, 0
        )
        outcome.fix = mismatch.fix_line(differ, script_roots(job.cfg))
        return outcome
    return report.Outcome.hang(line, details, job.cfg.hang_timeout)


def script_roots(cfg: LaunchConfig) -> list[Path]:
    """Where the script's files are: its folder, and the folder the job started in."""
    roots = [Path.cwd()]
    if cfg.kind == "script":
        roots.insert(0, Path(cfg.target).resolve().parent)
    return roots


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
