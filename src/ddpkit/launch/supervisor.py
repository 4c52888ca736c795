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
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

import ddpkit
from ddpkit import procs, protocol
from ddpkit.errors import LaunchError
from ddpkit.launch import hang, report
from ddpkit.launch.config import LaunchConfig
from ddpkit.launch.nodes import NodeGroup, bind_host, join
from ddpkit.launch.output import RankOutput
from ddpkit.launch.ports import listen

PR_SET_CHILD_SUBREAPER = 36
POLL = 0.05


@dataclass
class Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    output: RankOutput
    exit_code: int | None = None
    ended_wall: float = 0.0
    stopped: bool = False  # ended by the launcher's teardown, not by itself

    @property
    def pgid(self) -> int:
        return self.proc.pid  # each worker leads its own session and group


@dataclass
class Signals:
    """Ctrl+C / SIGTERM received by the launcher."""

    count: int = 0
    last: int = 0
    times: list[float] = field(default_factory=list)

    def handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.last = signum
        self.times.append(time.monotonic())


def launch(cfg: LaunchConfig) -> int:
    """Run the job described by `cfg`; return the exit code for `ddpkit run`."""
    _become_subreaper()
    if cfg.multi_node:
        meet = cfg.rdzv or f"{cfg.master_addr}:{cfg.master_port + 1}"
        _say(f"waiting up to {cfg.init_timeout:g} s for {cfg.nnodes} nodes to meet at {meet}")
    node = join(cfg)  # before our handlers: Ctrl+C while waiting for nodes just stops
    signals = Signals()
    previous = {s: signal.signal(s, signals.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    run_dir = make_run_dir(cfg, node)
    world = cfg.nproc_per_node * node.nnodes
    backend = {"gloo": "gloo on CPU", "nccl": "nccl"}.get(cfg.backend, "auto backend")
    _say(
        f"run {node.run_id}: {cfg.nproc_per_node} process(es) on this node"
        f"{f' (node {node.group_rank} of {node.nnodes})' if node.nnodes > 1 else ''}, "
        f"world size {world}, {backend}; logs in {run_dir}"
    )
    watchdog = _start_watchdog(node.run_id, cfg.grace)
    node.start_heartbeat()
    code = 1
    try:
        for attempt in range(cfg.max_restarts + 1):
            outcome = _run_attempt(cfg, node, run_dir, attempt, signals, watchdog)
            code = outcome.exit_code
            if outcome.ok:
                node.finish()
                break
            print(outcome.text, file=sys.stderr, flush=True)
            if signals.count or outcome.interrupted or attempt == cfg.max_restarts:
                node.abort(outcome.summary)
                break
            _say(f"restarting the whole group ({attempt + 1} of {cfg.max_restarts})")
    finally:
        node.stop()
        _finish_watchdog(watchdog)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code


def _run_attempt(
    cfg: LaunchConfig,
    node: NodeGroup,
    run_dir: Path,
    attempt: int,
    signals: Signals,
    watchdog: subprocess.Popen[bytes],
) -> report.Outcome:
    state_dir = run_dir / f"state{attempt}"
    state_dir.mkdir(mode=0o700)
    sock = None
    if node.hosts_store:
        sock = listen(bind_host(node.master_addr), cfg.master_port)
        port = sock.getsockname()[1]
        node.publish(f"master_port/{attempt}", str(port))
    else:
        port = cfg.master_port or int(node.fetch(f"master_port/{attempt}"))
    workers: list[Worker] = []
    store = None
    try:
        for local_rank in range(cfg.nproc_per_node):
            rank = node.group_rank * cfg.nproc_per_node + local_rank
            env = worker_env(cfg, node, rank, local_rank, port, attempt, state_dir)
            workers.append(_start_worker(cfg, rank, local_rank, env, run_dir))
            _tell_watchdog(watchdog, f"group {workers[-1].pgid}")
        if sock is not None:  # hand the held port to the store the workers will meet at
            store = _serve_store(sock, node.master_addr, port, cfg.init_timeout)
            sock = None
        outcome = _supervise(cfg, node, workers, state_dir, signals)
    finally:
        _stop_workers(workers, cfg.grace, signals, node.run_id)
        for w in workers:
            w.output.close()
        if sock is not None:
            sock.close()
        del store
        _reap_orphans({w.proc.pid for w in workers})
    outcome.finalize(workers, run_dir, state_dir)
    return outcome


def worker_env(
    cfg: LaunchConfig,
    node: NodeGroup,
    rank: int,
    local_rank: int,
    port: int,
    attempt: int,
    state_dir: Path,
) -> dict[str, str]:
    """The variables torchrun sets, plus ddpkit's own."""
    world = cfg.nproc_per_node * node.nnodes
    env = dict(os.environ)
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
            "ROLE_NAME": "default",
            "MASTER_ADDR": node.master_addr,
            "MASTER_PORT": str(port),
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
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cfg.track and cfg.hang_timeout > 0:
        # NCCL's flight recorder: the hang doctor's record of collectives in flight
        if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
            env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(state_dir / "nccl_trace_rank"))
    if not cfg.track:
        env[protocol.TRACK] = "0"
    if cfg.check_collectives:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if cfg.omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(cfg.omp_threads)
    if cfg.backend == "gloo":
        env[protocol.BACKEND] = "gloo"
    package_root = str(Path(ddpkit.__file__).resolve().parent.parent)
    if package_root not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _start_worker(
    cfg: LaunchConfig, rank: int, local_rank: int, env: dict[str, str], run_dir: Path
) -> Worker:
    cmd = [sys.executable, "-m", "ddpkit.rank.bootstrap", cfg.kind, cfg.target, *cfg.args]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    show = cfg.ranks is None or rank in cfg.ranks
    output = RankOutput(rank, str(run_dir / f"rank{rank}.log"), show, not cfg.raw_output)
    if proc.stdout is None or proc.stderr is None:
        raise RuntimeError("worker pipes missing")
    output.start(proc.stdout, proc.stderr)
    return Worker(rank, local_rank, proc, output)


def _serve_store(sock: Any, addr: str, port: int, timeout: float) -> Any:
    """The workers' TCPStore, listening on the socket the launcher already holds."""
    import torch.distributed as dist

    fd = sock.detach()
    for use_libuv in (True, False):  # older torch takes a listen fd only without libuv
        try:
            return dist.TCPStore(
                addr,
                port,
                None,
                True,
                timedelta(seconds=timeout),
                wait_for_workers=False,
                master_listen_fd=fd,
                use_libuv=use_libuv,
            )
        except (RuntimeError, ValueError):
            continue
    os.close(fd)
    raise LaunchError(
        f"could not start the job's store on {addr}:{port}",
        fix="pass --master-port with a free port",
    )


def _supervise(
    cfg: LaunchConfig, node: NodeGroup, workers: list[Worker], state_dir: Path, signals: Signals
) -> report.Outcome:
    next_init_check = 0.0
    watch = hang.HangWatch(workers, state_dir, cfg.hang_timeout)
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
            return report.Outcome.rank_failed(
                [w for w in workers if w.exit_code not in (None, 0)], state_dir
            )
        if all(w.exit_code == 0 for w in workers):
            return report.Outcome.success()
        if node.lost:
            return report.Outcome.launcher_failure(f"another node failed: {node.lost}")
        if watch.hung(now):
            line, details = hang.describe(workers, state_dir, watch.stalled_for(now))
            return report.Outcome.hang(line, details)
        if now >= next_init_check:
            next_init_check = now + 0.5
            missing = _missing_at_init(workers, state_dir, cfg.init_timeout)
            if missing:
                return report.Outcome.launcher_failure(missing)
        time.sleep(POLL)


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
            w.exit_code, w.ended_wall = 1, written
            stuck.append(w)
    return stuck


def _missing_at_init(workers: list[Worker], state_dir: Path, timeout: float) -> str | None:
    """A verdict when some ranks have waited in init_process_group for `timeout` s while
    others never got there."""
    phases = {w.rank: protocol.read_phase(state_dir, w.rank) for w in workers}
    waiting = {r: t for r, (p, t) in phases.items() if p == "init"}
    if not waiting:
        return None
    absent = [
        w.rank
        for w in workers
        if phases[w.rank][0] in ("starting", "started") and w.exit_code is None
    ]
    waited = time.time() - min(waiting.values())
    if not absent or waited < timeout:
        return None
    return (
        f"rank {report.ranks_text(absent)} never reached init_process_group; rank "
        f"{report.ranks_text(sorted(waiting))} waited {waited:.0f} s for it "
        f"(--init-timeout {timeout:g})"
    )


def _stop_workers(workers: list[Worker], grace: float, signals: Signals, run_id: str) -> None:
    """TERM every worker's group and every process of the run, wait up to `grace`, KILL."""
    count_before = signals.count
    stragglers = procs.processes_of_job(run_id, os.getpid())
    for w in workers:
        _killpg(w.pgid, signal.SIGCONT)
        _killpg(w.pgid, signal.SIGTERM)
    for p in stragglers:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + grace

    def impatient() -> bool:  # a second Ctrl+C, or any during a teardown for another reason
        return signals.count >= 2 or signals.count > count_before

    while time.monotonic() < deadline and not impatient():
        if not any(w.proc.poll() is None for w in workers) and not any(
            procs.is_alive(p) for p in stragglers
        ):
            break
        time.sleep(POLL)
    for w in workers:
        _killpg(w.pgid, signal.SIGKILL)
    left = procs.processes_of_job(run_id, os.getpid()) + stragglers
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=5)
        if w.exit_code is None:
            w.exit_code, w.ended_wall, w.stopped = w.proc.returncode, time.time(), True
    procs.wait_gone(left, 5.0)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _become_subreaper() -> None:
    """Orphans of our workers re-parent to the launcher (not init), so none escapes notice."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_orphans(worker_pids: set[int]) -> None:
    for child in psutil.Process().children():
        if child.pid not in worker_pids:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(child.pid, os.WNOHANG)


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
        assert watchdog.stdin is not None  # noqa: S101 - PIPE given
        watchdog.stdin.write(line.encode() + b"\n")
        watchdog.stdin.flush()


def _finish_watchdog(watchdog: subprocess.Popen[bytes]) -> None:
    _tell_watchdog(watchdog, "done")
    with contextlib.suppress(OSError):
        assert watchdog.stdin is not None  # noqa: S101
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def make_run_dir(cfg: LaunchConfig, node: NodeGroup) -> Path:
    """The run's folder (0700): one log per rank, state files, reports."""
    if cfg.log_dir is not None:
        base = cfg.log_dir
    else:
        import tempfile

        base = Path(tempfile.gettempdir()) / f"ddpkit-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = node.run_id if node.nnodes == 1 else f"{node.run_id}-node{node.group_rank}"
    run_dir = base / name
    if run_dir.exists():  # the same --run-id again: keep the earlier run's logs
        run_dir = base / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    return run_dir


def _say(text: str) -> None:
    print(f"ddpkit: {text}", file=sys.stderr, flush=True)
