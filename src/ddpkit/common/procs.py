"""Distributed-training processes on this machine: find them, describe them, end them.

A process belongs to a job when its environment says so: DDPKIT_RUN_ID (ddpkit run),
TORCHELASTIC_RUN_ID (torchrun), or RANK with WORLD_SIZE (started by hand). The environment is
inherited by everything a worker starts, so data-loader workers and subprocesses are found
even when they left the worker's process group. Ending is always TERM, grace, then KILL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

from ddpkit.common import protocol
from ddpkit.errors import debug_note

LAUNCHER_WORDS = (
    "ddpkit run",
    "ddpkit.cli run",
    "torchrun",
    "torch.distributed.run",
    "torch.distributed.launch",
)


TREE_AGE = 1.0  # seconds a process tree found by tree() is used again
_trees: dict[int, tuple[float, list[psutil.Process]]] = {}


def tree(pid: int, max_age: float = TREE_AGE) -> list[psutil.Process]:
    """The process `pid` and its descendants (psutil.NoSuchProcess when it is gone). Finding
    descendants reads every process's /proc entry; the launcher's watches (hang: usage,
    speed: CPU share and the job's pids) each ask every second, so a tree found less than
    `max_age` s ago is given again: one scan serves them all."""
    now = time.monotonic()
    found = _trees.get(pid)
    if found is not None and now - found[0] < max_age and found[1][0].is_running():
        return found[1]
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    _trees[pid] = (now, procs)
    if len(_trees) > 256:  # ranks of earlier attempts
        for old in [p for p, (at, _) in _trees.items() if now - at > max_age]:
            del _trees[old]
    return procs


@dataclass
class TrainingProcess:
    pid: int
    job: str
    rank: str  # "" for a launcher, "launcher" shown instead
    role: str  # launcher | worker | child | spare (ddpkit.launch.spares)
    state: str
    age_s: float
    cmd: str
    orphan: bool
    ports: list[int] = field(default_factory=list)
    gpu_mem_mib: int | None = None


def job_of(environ: dict[str, str]) -> str | None:
    if protocol.JOB in environ:
        return environ[protocol.JOB]
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun:" + environ["TORCHELASTIC_RUN_ID"]
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "env:" + environ.get("MASTER_PORT", "?")
    return None


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return dict(proc.environ())
    except (psutil.Error, OSError):
        return {}


def _launcher_job(proc: psutil.Process) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if not any(word in cmd for word in LAUNCHER_WORDS):
        return None
    for child in proc.children():
        job = job_of(_environ(child))
        if job:
            return job
    return None


def shown_command(words: list[str]) -> str:
    """The command as the user wrote it: a rank of ddpkit run shows its script ('python
    train.py --lr 3e-4'), not the bootstrap that runs it."""
    if "ddpkit.rank.bootstrap" in words:
        at = words.index("ddpkit.rank.bootstrap")
        rest = words[at + 1 :]
        if len(rest) >= 2:
            kind, target, *args = rest
            python = os.path.basename(words[0]) if words else "python"
            if kind == "function":  # ddpkit.spawn's rank: the script, and the function it runs
                return f"{python} {target} (ddpkit.spawn: {args[0] if args else '?'})"
            shown = {"script": [python, target], "module": [python, "-m", target]}
            return " ".join(shown.get(kind, [target]) + args)
    return " ".join(words)


def port_holder(port: int) -> tuple[str, str | None]:
    """('pid N (command)', the ddpkit job it belongs to or None) of what listens on `port`,
    when this user can see it; ('', None) otherwise."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN" and conn.pid:
                proc = psutil.Process(conn.pid)
                text = shown_command(proc.cmdline()) or proc.name()
                text = text if len(text) <= 60 else text[:57] + "..."
                job = job_of(_environ(proc)) or _launcher_job(proc)
                if job is not None and job.startswith(("env:", "torchrun:")):
                    return f"pid {conn.pid} ({text}; {job.split(':')[0]} job)", job
                return f"pid {conn.pid} ({text})", job
    except (psutil.Error, OSError):
        pass
    return "", None


def port_taken_fix(port: int, whose: str = "the script's") -> str:
    """What to do about a port another process holds, naming the holder where it can be seen."""
    holder, job = port_holder(port)
    by = f"port {port} is held by {holder}" if holder else f"port {port} is held by another process"
    if job is not None and job == os.environ.get(protocol.JOB):  # never: kill the job itself
        by += ", a process of this same job (another rank, or a process a rank started)"
        job = None
    kill = f"; `ddpkit kill {job}` ends that job" if job and ":" not in job else ""
    return (
        f"{by}: let ddpkit run choose the port (drop {whose} own MASTER_PORT: ddpkit run gives "
        f"every rank a free one), or pass ddpkit run --master-port with a free port{kill}"
    )


def list_training_processes() -> list[TrainingProcess]:
    """Every launcher, worker and worker's child visible to this user."""
    gpu_mem = _gpu_memory_by_pid()
    me = os.getpid()
    found: list[TrainingProcess] = []
    procs = list(psutil.process_iter(["pid", "ppid", "create_time", "status", "cmdline", "name"]))
    environs = {proc.pid: _environ(proc) for proc in procs if proc.pid != me}
    # a launcher that is not `ddpkit run` (a script calling ddpkit.spawn, a notebook's kernel)
    # is known by its ranks: they name it
    launched = {
        int(env[protocol.LAUNCHER_PID]): job
        for env in environs.values()
        if protocol.LAUNCHER_PID in env
        and (job := job_of(env))
        and env[protocol.LAUNCHER_PID].isdigit()
    }
    for proc in procs:
        if proc.pid == me:
            continue
        environ = environs[proc.pid]
        job = job_of(environ)
        role = "worker" if job and environ.get("RANK") is not None else "child"
        if job is None:
            job = _launcher_job(proc) or launched.get(proc.pid)
            role = "launcher"
        elif protocol.LAUNCHER_PID not in environ and _launcher_job(proc):
            role = "launcher"
        if job is None:
            continue
        if role == "worker" and proc.info["ppid"] and _is_job_member(proc.info["ppid"], job):
            role = "child"  # e.g. a DataLoader worker: same env as its rank
        if role == "worker" and proc.info["name"] == protocol.SPARE_NAME.decode():
            role = "spare"  # waits to take its rank's place at a restart
        found.append(
            TrainingProcess(
                pid=proc.pid,
                job=job,
                rank=environ.get("RANK", "") if role != "launcher" else "",
                role=role,
                state=proc.info["status"],
                age_s=time.time() - proc.info["create_time"],
                cmd=shown_command(proc.info["cmdline"] or [])[:80],
                orphan=_is_orphan(proc, environ),
                ports=_listening_ports(proc),
                gpu_mem_mib=gpu_mem.get(proc.pid),
            )
        )
    return sorted(found, key=lambda p: (p.job, p.role != "launcher", p.rank, p.pid))


def job_workers(job: str | None, command: str) -> tuple[str, list[TrainingProcess]]:
    """The running job named `job` (or the only one) and its ranks on this machine; a
    ConfigError naming what to do when there is none or several. `command` says who asks."""
    from ddpkit.errors import ConfigError

    workers = [p for p in list_training_processes() if p.role == "worker"]
    jobs = sorted({p.job for p in workers})
    job = job or (jobs[0] if len(jobs) == 1 else None)
    if job is None and not jobs:
        raise ConfigError(
            "no training job is running on this machine (none that this user can see)",
            fix=f"`ddpkit {command}` reads a running job: start one with `ddpkit run ...`; a job "
            "that ended left its report and logs in its run folder ($TMPDIR/ddpkit-$UID/latest)",
        )
    if job is None:
        raise ConfigError(
            f"{len(jobs)} jobs are running: {', '.join(jobs)}",
            fix=f"name one: `ddpkit {command} JOB` (see `ddpkit ps`)",
        )
    mine = [p for p in workers if p.job == job]
    # several nodes' ranks seen from one kernel (containers, network namespaces): this node's
    mine = [p for p in mine if _same_network(p.pid)] or mine
    if not mine:
        raise ConfigError(f"no job {job!r} on this machine", fix="see `ddpkit ps` for jobs")
    return job, mine


def _same_network(pid: int) -> bool:
    """Whether the process shares this one's network namespace (True when it cannot be told)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return True


def _is_job_member(pid: int, job: str) -> bool:
    try:
        return job_of(_environ(psutil.Process(pid))) == job
    except psutil.Error:
        return False


def _is_orphan(proc: psutil.Process, environ: dict[str, str]) -> bool:
    launcher = environ.get(protocol.LAUNCHER_PID)
    if launcher and launcher.isdigit() and not psutil.pid_exists(int(launcher)):
        return True
    try:
        return proc.ppid() in (0, 1) or not psutil.pid_exists(proc.ppid())
    except psutil.Error:
        return False


def _listening_ports(proc: psutil.Process) -> list[int]:
    try:
        conns = proc.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def _gpu_memory_by_pid() -> dict[int, int]:
    from ddpkit.common.gpus import nvml

    used: dict[int, int] = {}
    with nvml() as pynvml:
        if pynvml is None:
            return used
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    mib = (p.usedGpuMemory or 0) // 2**20
                    used[p.pid] = used.get(p.pid, 0) + mib
        except Exception as err:  # a partial answer is still worth showing
            debug_note("GPU memory per process", err)
    return used


def processes_of_job(job: str, launcher_pid: int | None = None) -> list[psutil.Process]:
    """Processes whose environment names `job` (and, if given, the launcher that started
    them: one node's share when several nodes of a job run on this machine), and every
    descendant of those."""
    members: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        environ = _environ(proc) if proc.pid != os.getpid() else {}
        if job_of(environ) != job:
            continue
        if launcher_pid is None or environ.get(protocol.LAUNCHER_PID) == str(launcher_pid):
            members[proc.pid] = proc
    for proc in list(members.values()):
        try:
            for child in proc.children(recursive=True):
                members.setdefault(child.pid, child)
        except psutil.Error:
            pass
    return list(members.values())


def terminate(
    procs: Iterable[psutil.Process],
    grace: float,
    groups: Iterable[int] = (),
    first: int = signal.SIGTERM,
    impatient: Callable[[], bool] = lambda: False,
    again: Callable[[], list[psutil.Process]] | None = None,
) -> list[psutil.Process]:
    """The one way ddpkit ends processes: `first` (SIGTERM, or the signal being forwarded) to
    the process groups `groups` and to `procs`, a wait of up to `grace` s (cut short when
    `impatient()` says so), then SIGKILL to the groups and to whatever is left, including what
    `again()` finds by then (processes started during the grace), and a wait until it is all
    gone. Stopped processes are continued first, so they can act on the signal. Never reaps:
    a launcher's Popen objects must still see their workers' exit codes. Returns the processes
    that were signalled."""
    targets = {p.pid: p for p in procs if p.pid != os.getpid()}
    group_ids = list(groups)
    members = [m for pgid in group_ids for m in _group_members(pgid)]
    in_groups = {m.pid for m in members}
    for member in members:
        targets.setdefault(member.pid, member)
    for pgid in group_ids:
        _killpg(pgid, signal.SIGCONT)
        _killpg(pgid, first)
    for proc in targets.values():
        if proc.pid not in in_groups:  # once each: a second SIGINT would cut a handler short
            _signal(proc, signal.SIGCONT)
            _signal(proc, first)
    deadline = time.monotonic() + grace
    alive = [p for p in targets.values() if is_alive(p)]
    while alive and time.monotonic() < deadline and not impatient():
        time.sleep(0.05)
        alive = [p for p in alive if is_alive(p)]
    for pgid in group_ids:
        _killpg(pgid, signal.SIGKILL)
    for proc in again() if again is not None else []:
        targets.setdefault(proc.pid, proc)
        alive.append(proc)
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    wait_gone(alive, 5.0)
    return list(targets.values())


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; its parent has yet to reap it). Never
    reaps: the launcher's Popen objects must see their workers' exit codes."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for `procs` to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if is_alive(p)]
    return alive


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (OSError, psutil.Error):
            continue
    return members


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        pass
