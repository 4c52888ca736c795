"""A job's workers: the environment each gets, how each is started (one pipe for its output,
the launcher's stdin for the rank that reads it), and how they are stopped (the signal the
launcher got goes to each rank; then everything of the job is killed after the grace) and
what they left behind is ended."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import psutil

from ddpkit.common import nccl_transport, procs, protocol
from ddpkit.launch import forked
from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.output import RankOutput
from ddpkit.launch.base.worker import Signals, Worker
from ddpkit.launch.peers.nodes import NodeGroup

log = logging.getLogger(__name__)

QUIETED = "_DDPKIT_QUIETED_TORCH"  # the launcher set TORCH_CPP_LOG_LEVEL for itself only
GRACEFUL_WAIT = 120.0  # seconds ranks that read s.stop_requested get to save after a signal
MEMORY_HISTORY_ENTRIES = 100_000  # --memory-snapshot: the allocator events a rank keeps


# Signals the launcher forwards to every worker before it stops the job (torchrun's
# --signals-to-handle, with SIGINT for Ctrl+C): SLURM pre-emption sends SIGUSR1 or SIGTERM, a
# closed ssh session SIGHUP.
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGQUIT,
)


def profile_plan(steps: tuple[int, int], run_dir: Path) -> str:
    """--profile-steps A-B as the ranks' plan (ddpkit.rank.profiling.Plan, as JSON)."""
    first, last = steps
    folder = run_dir / f"profile-{first}-{last}"
    return json.dumps({"first": first - 1, "steps": last - first + 1, "folder": str(folder),
                       "id": f"run-{first}-{last}"})  # fmt: skip


def worker_env(
    cfg: LaunchConfig,
    node: NodeGroup,
    rank: int,
    local_rank: int,
    attempt: int,
    state_dir: Path,
) -> dict[str, str]:
    """The variables torchrun sets, plus ddpkit's own."""
    world = cfg.nproc_per_node * node.nnodes
    env = dict(os.environ)
    if env.pop(QUIETED, None):
        env.pop("TORCH_CPP_LOG_LEVEL", None)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
            "GROUP_RANK": str(node.group_rank),
            "GROUP_WORLD_SIZE": str(node.nnodes),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": cfg.torchrun.role,
            "MASTER_ADDR": node.master_addr,
            "MASTER_PORT": str(node.master_port),
            "TORCHELASTIC_RUN_ID": node.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            protocol.JOB: node.run_id,
            protocol.LAUNCHER_PID: str(os.getpid()),
            protocol.STATE_DIR: str(state_dir),
            # setup()'s own bound is looser, so the launcher's verdict (naming the missing rank)
            # comes first.
            protocol.INIT_TIMEOUT: str(cfg.init_timeout + 30),
        }
    )
    if cfg.track and cfg.hang_timeout > 0:
        # NCCL's flight recorder: the hang doctor's record of collectives in flight
        if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
            env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(state_dir / "nccl_trace_rank"))
        if cfg.backend != "gloo":
            # NCCL's start events: the recorder then tells a collective whose kernel runs
            # (waiting for a peer) from one queued behind the rank's own GPU work
            env.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    if cfg.backend != "gloo" and "NCCL_DEBUG" not in env:
        # NCCL's own log of the transports it chose, into the run folder, never the console
        # (a user's NCCL_DEBUG is theirs: then nothing is read; ddpkit.common.nccl_transport)
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_FILE"] = str(state_dir.parent / nccl_transport.LOG_PATTERN)
    if node.held is not None and cfg.kind != "command":
        # one node: rank 0 serves the store on the socket the launcher holds; every rank dials
        # it as under plain torch (rank 0 the master), so the launcher needs no torch
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        if rank == 0:
            env[protocol.STORE_FD] = str(node.held.fileno())
    if not cfg.track:
        env[protocol.TRACK] = "0"
    if cfg.memory_snapshot:
        env[protocol.MEMORY_HISTORY] = str(MEMORY_HISTORY_ENTRIES)
    if cfg.check_collectives:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if cfg.profile_steps is not None and attempt == 0:  # a restart numbers its steps anew
        env[protocol.PROFILE] = profile_plan(cfg.profile_steps, state_dir.parent)
    if cfg.omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(cfg.omp_threads)
    if cfg.backend == "gloo":
        env[protocol.BACKEND] = "gloo"
    env[protocol.FRAMED] = "1"
    # torch's @record writes a failing rank's error here, as under torchrun
    env["TORCHELASTIC_ERROR_FILE"] = str(protocol.state_path(state_dir, rank, protocol.TORCH_ERROR))
    return env


def worker_command(cfg: LaunchConfig, env: dict[str, str], spare: int | None = None) -> list[str]:
    """The worker's command line; a warm spare's has `--spare FD` before the script."""
    args = list(cfg.args)
    if cfg.torchrun.local_rank_arg:  # torch.distributed.launch put it first
        args.insert(0, f"{cfg.torchrun.local_rank_arg}={env['LOCAL_RANK']}")
    waits = ["--spare", str(spare)] if spare is not None else []
    return [sys.executable, "-m", "ddpkit.rank.bootstrap", *waits, cfg.kind, cfg.target, *args]


def start_worker(cfg: LaunchConfig, rank: int, env: dict[str, str], run_dir: Path) -> Worker:
    if cfg.forked is not None:  # a notebook's function: the rank is a fork of this process
        child = forked.start(cfg.forked, env, [*FORWARDED, *cfg.torchrun.signals])
        return worker_of(cfg, rank, env, run_dir, cast("subprocess.Popen[bytes]", child))
    cmd = worker_command(cfg, env)
    reads_stdin = stdin_rank(cfg) == rank
    store_fd = env.get(protocol.STORE_FD)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=None if reads_stdin else subprocess.DEVNULL,  # None: the launcher's own
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe: the order the rank printed in
        start_new_session=True,
        pass_fds=(int(store_fd),) if store_fd else (),
    )
    return worker_of(cfg, rank, env, run_dir, proc)


def worker_of(
    cfg: LaunchConfig, rank: int, env: dict[str, str], run_dir: Path, proc: subprocess.Popen[bytes]
) -> Worker:
    """The rank's worker around its process (started now, or a warm spare taking its place):
    its output read from the pipe into the rank's log and the console."""
    output = RankOutput(
        rank,
        str(run_dir / f"rank{rank}.log"),
        shown_streams(cfg, rank, int(env["LOCAL_RANK"])),
        not cfg.raw_output,
        reads_stdin=stdin_rank(cfg) == rank,
    )
    if proc.stdout is None:
        raise RuntimeError("worker pipe missing")
    output.start(proc.stdout)
    return Worker(rank, proc, output)


def shown_streams(cfg: LaunchConfig, rank: int, local_rank: int) -> frozenset[int]:
    """Which of a rank's streams (1 stdout, 2 stderr) reach the console: --ranks,
    --local-ranks-filter and --redirects decide; the log always gets both."""
    if cfg.ranks is not None and rank not in cfg.ranks:
        return frozenset()
    local_filter = cfg.torchrun.local_ranks
    if local_filter is not None and local_rank not in local_filter:
        return frozenset()
    hidden: frozenset[int] = frozenset()
    for who, streams in cfg.torchrun.hidden:
        if who in (-1, local_rank):
            hidden = streams
    return frozenset({1, 2}) - hidden


def stdin_rank(cfg: LaunchConfig) -> int | None:
    """The rank that reads the launcher's stdin (for breakpoint() and input()): --stdin N, or
    rank 0 when stdin is a terminal (auto), or none."""
    if cfg.stdin == "auto":
        try:
            return 0 if sys.stdin is not None and os.isatty(sys.stdin.fileno()) else None
        except (OSError, ValueError):
            return None
    return None if cfg.stdin == "none" else int(cfg.stdin)


def stop_workers(
    workers: list[Worker],
    grace: float,
    signals: Signals,
    run_id: str,
    graceful: set[int],
    keep: frozenset[int] = frozenset(),
) -> float:
    """Every worker's group and every process of the run: the signal the launcher got (a
    forwarded Ctrl+C is SIGINT, so scripts see KeyboardInterrupt), or SIGTERM; SIGKILL after
    `grace`, at once on a person's second Ctrl+C (a repeated SIGTERM is one request). Then
    each worker's exit code is collected. Returns the grace the ranks were given. `keep`: the
    next attempt's warm spares (ddpkit.launch.spares)."""
    count_before = signals.count
    first = signals.last if signals.count else signal.SIGTERM
    alive = [w for w in workers if w.proc.poll() is None]
    if signals.count and alive and all(w.rank in graceful for w in alive):
        # every rank reads s.stop_requested: it saves its state before it leaves
        grace = max(grace, GRACEFUL_WAIT)

    def impatient() -> bool:  # a person's second Ctrl+C, or a stop during another teardown
        return signals.urgent or signals.count > count_before

    groups = [w.pgid for w in alive]
    log.debug(
        "stopping ranks %s: %s first, SIGKILL after %g s",
        [w.rank for w in alive],
        signal.Signals(first).name,
        grace,
    )
    if signals.count:
        # a forwarded signal goes to each rank itself, as torchrun sends it: the rank decides
        # (its DataLoader workers and children are its business until the grace is over)
        leaders = [psutil.Process(w.proc.pid) for w in alive if _exists(w.proc.pid)]
        procs.terminate(leaders, grace, first=first, impatient=impatient)
        given, grace, first = grace, 0.0, signal.SIGKILL
    else:
        given = grace

    def of_the_attempt() -> list[psutil.Process]:
        return [p for p in procs.processes_of_job(run_id, os.getpid()) if p.pid not in keep]

    procs.terminate(
        of_the_attempt(),
        grace,
        groups=groups,
        first=first,
        impatient=impatient,
        again=of_the_attempt,
    )
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=5)
        if w.exit_code is None:
            w.exit_code, w.ended_wall = w.proc.returncode, time.time()
            # after a forwarded signal a rank ends on its own (saved, or as the signal says)
            # unless it outlived the grace; after a failure, ddpkit's teardown ended it
            w.stopped = w.exit_code == -signal.SIGKILL if signals.count else True
            w.killed_at_once = w.stopped and signals.urgent
    return given


def _exists(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def end_orphans(worker_pids: set[int], watchdog_pid: int) -> None:
    """What the job left behind that re-parented to the launcher (a subreaper): a daemon that
    double-forked and dropped its environment is found here, ended, and reaped."""
    me = psutil.Process()
    left = [p for p in me.children() if p.pid not in worker_pids and p.pid != watchdog_pid]
    for orphan in list(left):
        with contextlib.suppress(psutil.Error):
            left += orphan.children(recursive=True)
    if left:
        procs.terminate(left, 1.0)
    for child in me.children():
        if child.pid != watchdog_pid:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(child.pid, os.WNOHANG)
