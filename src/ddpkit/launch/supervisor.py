"""Start the workers, watch them, stop them all: the loop behind `ddpkit run`.

Promises: every worker runs in a process group of its own, tied to the launcher by a death
signal, and watched by a watchdog process that ends the job if the launcher is SIGKILLed. When
a rank fails, when the user presses Ctrl+C or sends SIGTERM, when a rank never reaches init, or
when another node is lost, every worker's group (and every process carrying the run id in its
environment) gets SIGTERM, then SIGKILL after the grace period; a second Ctrl+C kills at once.
The exit code is the root-cause rank's (128+N for signal N), 130/143 after Ctrl+C/SIGTERM, and 1
for failures the launcher found itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddpkit.common import protocol
from ddpkit.common.ranges import ranks_text
from ddpkit.errors import debug_enabled
from ddpkit.launch import causes, report, rundir
from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.hang import blame
from ddpkit.launch.hang import places as rank_places
from ddpkit.launch.hang import watch as hang
from ddpkit.launch.hang.watch import HANG_EXIT_CODE
from ddpkit.launch.output import CONSOLE
from ddpkit.launch.peers import crossnode
from ddpkit.launch.peers.liveness import BEAT, Abort, Liveness
from ddpkit.launch.peers.nodes import CALL_LIMIT, NodeGroup, join
from ddpkit.launch.speed.watch import SpeedWatch
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
POLL = 0.05


def launch(cfg: LaunchConfig) -> int:
    """Run the job described by `cfg`; return the exit code for `ddpkit run`."""
    _become_subreaper()
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # torch's C++ warnings about the launchers' own store connections (a node gone, a
        # reverse lookup) are noise: ddpkit says what happened. The workers keep torch's level.
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        os.environ[QUIETED] = "1"
    if cfg.multi_node:
        meet = cfg.rdzv or f"{cfg.master_addr}:{cfg.master_port}"
        _say(f"waiting up to {cfg.init_timeout:g} s for {cfg.nnodes} nodes to meet at {meet}")
    base = rundir.base_folder(cfg.log_dir)  # bad --log-dir: an error before anything starts
    node = join(cfg)  # before our handlers: Ctrl+C while waiting for nodes just stops
    signals = Signals()
    forwarded = set(FORWARDED) | set(cfg.torchrun.signals)
    previous = {s: signal.signal(s, signals.handle) for s in forwarded}
    watchdog = None
    code = 1
    try:
        name = node.run_id if node.nnodes == 1 else f"{node.run_id}-node{node.group_rank}"
        run_dir = rundir.make(base, name)
        rundir.mark_latest(base, run_dir)
        with contextlib.suppress(OSError):
            rundir.prune(base)
        _say_start(cfg, node, run_dir)
        watchdog = _start_watchdog(node.run_id, cfg.grace)
        attempt, rounds, began = 0, 0, time.monotonic()
        while True:
            live = Liveness(node, cfg.node_timeout, elastic=cfg.min_nodes < cfg.nnodes)
            live.start()
            state_dir = run_dir / f"state{rounds}"
            outcome = _run_attempt(cfg, node, live, state_dir, attempt, signals, watchdog)
            code, rounds = outcome.exit_code, rounds + 1
            if node.multi_node and debug_enabled():
                _say(f"liveness: {live.beats} beats, longest gap {live.longest_gap:.2f} s")
            if outcome.ok:
                crossnode.finish(node, live)
                _say(_done_line(run_dir, time.monotonic() - began))
                break
            # a node that serves a store waits for the others to read why (bounded)
            hurry = signals.count > 0
            crossnode.leave(node, live, 1.0 if hurry else cfg.node_timeout, hurry=hurry)
            if outcome.membership and not signals.count:
                _say(f"the job's nodes change ({outcome.summary}): every node starts again")
            elif _restarts(cfg, outcome, attempt, signals):
                # not the job's end: no exit code yet, the group starts again
                text = outcome.text.lstrip("\n").rsplit("\n  exit code:", 1)[0]
                tries = f"attempt {attempt + 1} of {cfg.max_restarts + 1}"
                _say(text.replace("ddpkit: the job ", f"ddpkit: {tries}: the job ", 1), prefix="")
                attempt += 1
                _say(f"restarting the whole group ({attempt} of {cfg.max_restarts})")
            else:
                _say(outcome.text.lstrip("\n"), prefix="")
                break
            node = crossnode.next_round(cfg, node)
    finally:
        node.close()
        if watchdog is not None:
            _finish_watchdog(watchdog)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code


def _done_line(run_dir: Path, seconds: float) -> str:
    files = [name for name in ("speed.json", "steps.png") if (run_dir / name).exists()]
    also = f" ({', '.join(files)} beside the logs)" if files else ""
    return f"done in {seconds:.1f} s: every rank exited 0; logs in {run_dir}{also}"


def _restarts(cfg: LaunchConfig, outcome: report.Outcome, attempt: int, signals: Signals) -> bool:
    return outcome.restartable and not signals.count and attempt < cfg.max_restarts


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


def _run_attempt(
    cfg: LaunchConfig,
    node: NodeGroup,
    live: Liveness,
    state_dir: Path,
    attempt: int,
    signals: Signals,
    watchdog: subprocess.Popen[bytes],
) -> report.Outcome:
    run_dir = state_dir.parent
    state_dir.mkdir(mode=0o700)
    workers: list[Worker] = []
    speed = None
    given = cfg.grace
    try:
        for local_rank in range(cfg.nproc_per_node):
            if signals.count:  # Ctrl+C or SIGTERM while starting: start no more
                break
            rank = node.group_rank * cfg.nproc_per_node + local_rank
            env = worker_env(cfg, node, rank, local_rank, attempt, state_dir)
            workers.append(start_worker(cfg, rank, env, run_dir))
            _tell_watchdog(watchdog, f"group {workers[-1].pgid}")
        if cfg.kind == "command":  # a program, not Python: its rank 0 cannot serve the store
            # one node: the workers' connections wait till now
            node.serve_store(cfg.init_timeout, stop=lambda: signals.count > 0)
        speed = SpeedWatch(
            workers,
            state_dir,
            run_dir,
            cfg.straggler_threshold,
            cfg.straggler_window,
            node.host,
            live if node.multi_node else None,
            node.group_rank,
        )
        outcome = _supervise(cfg, node, live, workers, state_dir, signals, speed)
        if node.multi_node and outcome.from_node is None and not outcome.ok:
            # this node knows why: the others stop for the same reason, before this node's
            # ranks go and theirs fail for want of a peer
            why = f"node {node.group_rank} ({node.host}): {outcome.summary}"
            others = outcome.exit_code if outcome.exit_code == HANG_EXIT_CODE else 1
            restart = _restarts(cfg, outcome, attempt, signals)
            limit = 0.5 if signals.count else CALL_LIMIT
            crossnode.publish_abort(node, Abort(node.group_rank, why, others, restart), limit)
    finally:
        given = stop_workers(workers, cfg.grace, signals, node.run_id, state_dir)
        for w in workers:
            w.output.close()
        end_orphans({w.proc.pid for w in workers}, watchdog.pid)
    if speed is not None and not signals.count:
        summary = speed.finish()  # speed.json and steps.png, whatever the outcome
        while speed.notes:
            _say(speed.notes.pop(0))
        if summary and outcome.ok:  # after a failure the step times are beside the point
            _say(summary)
    outcome.grace = given
    outcome.finalize(workers, run_dir, state_dir)
    return outcome


def _supervise(
    cfg: LaunchConfig,
    node: NodeGroup,
    live: Liveness,
    workers: list[Worker],
    state_dir: Path,
    signals: Signals,
    speed: SpeedWatch,
) -> report.Outcome:
    next_init_check = 0.0
    watch = hang.HangWatch(workers, state_dir, cfg.hang_timeout, live if node.multi_node else None)
    oom = causes.OomWatch()
    answered_hang = False
    while True:
        now = time.monotonic()
        for w in workers:
            if w.exit_code is None and (code := w.proc.poll()) is not None:
                w.exit_code, w.ended_wall = code, time.time()
        if signals.count:
            name = signal.Signals(signals.last).name
            return report.Outcome.interrupted_by(name, 128 + signals.last)
        failed = [w for w in workers if w.exit_code not in (None, 0)] or _errored(
            workers, state_dir, now
        )
        if failed:
            # let near-simultaneous exits land, so the root cause is chosen among them
            time.sleep(0.2)
            for w in workers:
                if w.exit_code is None and (code := w.proc.poll()) is not None:
                    w.exit_code, w.ended_wall = code, time.time()
            outcome = report.Outcome.rank_failed(
                [w for w in workers if w.exit_code not in (None, 0)], state_dir, oom
            )

            def places_of(ranks: list[int]) -> dict[int, tuple[str, str]]:
                alive = [w for w in workers if w.rank in ranks]
                stop = lambda: signals.count > 0  # noqa: E731
                return rank_places.collect(alive, state_dir, hung=False, stop=stop)[0]

            culprit = blame.find_culprit(workers, state_dir, places_of)
            if culprit is not None:
                outcome.blame(culprit, state_dir)
            if node.multi_node and outcome.victim:
                return _cause_elsewhere(outcome, node, live, signals, cfg.node_timeout)
            return outcome
        if CONSOLE.closed:
            return report.Outcome.launcher_failure(f"{CONSOLE.closed}; the job is stopped")
        if live.abort is not None and (live.abort.node != node.group_rank or live.abort.membership):
            return report.Outcome.other_node(live.abort)
        if live.lost:
            return report.Outcome.node_lost(live.lost)
        if all(w.exit_code == 0 for w in workers):
            return report.Outcome.success()
        if live.hang_asked and not answered_hang:
            answered_hang = True
            crossnode.publish_places(node, *rank_places.collect(workers, state_dir))
        if watch.hung(now):
            stall = watch.stalled_for(now)
            return _hang_outcome(node, workers, state_dir, stall, cfg, signals)
        while watch.notes:
            _say(watch.notes.pop(0))
        if watch.waits is not None:
            waits, watch.waits = watch.waits, None
            _say(
                rank_places.long_wait_note(
                    workers,
                    state_dir,
                    waits.waiting,
                    waits.working,
                    waits.began,
                    stop=lambda: signals.count > 0,
                )
            )
        speed.sample(now)
        while speed.notes:
            _say(speed.notes.pop(0))
        if now >= next_init_check:
            next_init_check = now + 0.5
            missing = _missing_at_init(workers, state_dir, cfg.init_timeout)
            if missing:
                outcome = report.Outcome.launcher_failure(missing)
                # where the missing ranks are instead: their stacks, as the hang doctor shows
                absent = [w for w in workers if _absent(w, state_dir)]
                stop = lambda: signals.count > 0  # noqa: E731
                outcome.details = rank_places.collect(absent, state_dir, False, stop)[1]
                return outcome
        time.sleep(cfg.torchrun.monitor_interval)


def _cause_elsewhere(
    outcome: report.Outcome, node: NodeGroup, live: Liveness, signals: Signals, bound: float
) -> report.Outcome:
    """This node's ranks failed only because a peer went away: wait (up to the node timeout)
    for the other nodes' word on why, and report that instead."""
    deadline = time.monotonic() + bound + BEAT
    while time.monotonic() < deadline and not signals.count:
        if live.abort is not None and (live.abort.node != node.group_rank or live.abort.membership):
            return report.Outcome.other_node(live.abort)
        if live.lost:
            return report.Outcome.node_lost(live.lost)
        time.sleep(POLL)
    return outcome


def _hang_outcome(
    node: NodeGroup,
    workers: list[Worker],
    state_dir: Path,
    stall: float,
    cfg: LaunchConfig,
    signals: Signals,
) -> report.Outcome:
    """The hang report; Ctrl+C or SIGTERM while it is collected cuts its waits short, so the
    launcher still ends within its grace."""

    def stop() -> bool:
        return signals.count > 0

    if not node.multi_node:
        line, details = rank_places.describe(workers, state_dir, stall, stop=stop)
    else:
        crossnode.ask_places(node)
        places, details = rank_places.collect(workers, state_dir, stop=stop)
        every, hosts, details = crossnode.collect_places(
            node, places, details, cfg.nproc_per_node, stop=stop
        )
        line = crossnode.hang_line(every, hosts, stall)
    if stop():
        name = signal.Signals(signals.last).name
        return report.Outcome.interrupted_by(name, 128 + signals.last)
    return report.Outcome.hang(line, details, cfg.hang_timeout)


ERROR_EXIT_WAIT = 3.0


def _errored(workers: list[Worker], state_dir: Path, now: float) -> list[Worker]:
    """Ranks that recorded an uncaught error but have not exited ERROR_EXIT_WAIT s later (e.g.
    stuck tearing down NCCL while a peer waits in a collective): failed all the same."""
    stuck = []
    for w in workers:
        if w.exit_code is not None:
            continue
        error = protocol.state_path(state_dir, w.rank, protocol.ERROR)
        try:
            written = error.stat().st_mtime
        except OSError:
            continue
        if time.time() - written > ERROR_EXIT_WAIT:
            record = protocol.read_error(state_dir, w.rank)
            code = record.exit_code if record and record.exit_code is not None else 1
            w.exit_code, w.ended_wall = code, written  # the code the rank meant to exit with
            stuck.append(w)
    return stuck


def _missing_at_init(workers: list[Worker], state_dir: Path, timeout: float) -> str | None:
    """A verdict when some ranks have waited in init_process_group for `timeout` s while
    others never got there."""
    phases = {w.rank: protocol.read_phase(state_dir, w.rank) for w in workers}
    waiting = {r: t for r, (p, t) in phases.items() if p == "init"}
    if not waiting:
        return None
    absent = [w.rank for w in workers if _absent(w, state_dir, phases[w.rank][0])]
    waited = time.time() - min(waiting.values())
    if not absent or waited < timeout:
        return None
    return (
        f"rank {ranks_text(absent)} never reached init_process_group; rank "
        f"{ranks_text(sorted(waiting))} waited {waited:.0f} s for it "
        f"(--init-timeout {timeout:g})"
    )


def _absent(w: Worker, state_dir: Path, phase: str | None = None) -> bool:
    """A live rank that has not reached init_process_group."""
    phase = phase or protocol.read_phase(state_dir, w.rank)[0]
    return phase in ("starting", "started") and w.exit_code is None


def _become_subreaper() -> None:
    """Orphans of our workers re-parent to the launcher (not init), so none escapes notice."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _start_watchdog(run_id: str, grace: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpkit.launch.watchdog",
            run_id,
            str(min(grace, 1.0)),
            str(os.getpid()),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if k not in protocol.WORKER_VARIABLES},
    )


def _tell_watchdog(watchdog: subprocess.Popen[bytes], line: str) -> None:
    with contextlib.suppress(OSError):
        assert watchdog.stdin is not None
        watchdog.stdin.write(line.encode() + b"\n")
        watchdog.stdin.flush()


def _finish_watchdog(watchdog: subprocess.Popen[bytes]) -> None:
    _tell_watchdog(watchdog, "done")
    with contextlib.suppress(OSError):
        assert watchdog.stdin is not None
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _say(text: str, prefix: str = "ddpkit: ") -> None:
    try:
        print(f"{prefix}{text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr is gone too: the exit code and report.txt still tell
