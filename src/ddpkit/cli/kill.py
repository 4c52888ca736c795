"""`ddpkit kill JOB|PID`: end a whole training job (launcher, ranks and everything they
started): SIGTERM, a grace period, then SIGKILL. Only what `ddpkit ps` lists as a training job
(ddpkit, torchrun, or started by hand with RANK/WORLD_SIZE) is a target, unless --force; never
pid 1 or this command's own ancestors. Says what it ended and what it could not; exit code 1
when anything is still alive."""

from __future__ import annotations

import argparse
import os


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kill", help="end a training job's whole process tree", description=__doc__)
    p.add_argument("job", help="a job id from `ddpkit ps`, or the pid of any of its processes")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between TERM and KILL")
    p.add_argument(
        "--force", action="store_true", help="also end a process tree that is not a training job"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import psutil

    from ddpkit.common.procs import is_alive, list_training_processes, processes_of_job, terminate
    from ddpkit.errors import ConfigError

    if not 0 <= args.grace <= 3600:
        raise ConfigError(f"--grace {args.grace} is not 0 to 3600 seconds", fix="e.g. --grace 5")
    found = list_training_processes()
    job = args.job
    if not any(p.job == job for p in found):
        if not job.isdigit():
            raise ConfigError(f"no job {job!r} on this machine", fix="see `ddpkit ps` for jobs")
        pid = int(job)
        _refuse_own(pid)
        match = next((p for p in found if p.pid == pid), None)
        if match is not None:
            job = match.job
        elif not psutil.pid_exists(pid):
            raise ConfigError(f"no process with pid {pid}", fix="see `ddpkit ps`")
        elif not args.force:
            raise ConfigError(
                f"pid {pid} ({_name(pid)}) is not a training job ddpkit can identify (not "
                "started by ddpkit run or torchrun, no RANK/WORLD_SIZE in its environment)",
                fix=f"`ddpkit ps` lists training jobs; to end this tree anyway: "
                f"ddpkit kill --force {pid}",
            )
        else:
            job = None
            root = psutil.Process(pid)
            targets = [root, *root.children(recursive=True)]
    if job is not None:
        launchers = [psutil.Process(p.pid) for p in found if p.job == job and p.role == "launcher"]
        targets = launchers + processes_of_job(job)
    mine = os.getpid()
    targets = [t for t in targets if t.pid != mine and t.pid not in _ancestors()]
    signalled = terminate(targets, args.grace)
    left = [p for p in signalled if is_alive(p)]
    ended = [p for p in signalled if p not in left]
    if ended:
        print(f"ended {len(ended)} process(es): " + ", ".join(str(p.pid) for p in ended))
    if left:
        print(
            f"could not end {len(left)} process(es): "
            + ", ".join(f"{p.pid} ({_why_alive(p)})" for p in left)
        )
        return 1
    return 0


def _ancestors() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().parents()}


def _refuse_own(pid: int) -> None:
    from ddpkit.errors import ConfigError

    if pid == 1 or pid == os.getpid() or pid in _ancestors():
        raise ConfigError(
            f"pid {pid} is {'init' if pid == 1 else 'this command or one of its parents'}: "
            "ending it would end this session",
            fix="give the pid of a training process (see `ddpkit ps`)",
        )


def _name(pid: int) -> str:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def _why_alive(proc: object) -> str:
    import psutil

    try:
        owner = proc.username()  # type: ignore[attr-defined]
    except psutil.Error:
        return "still running"
    me = psutil.Process().username()
    return f"owned by {owner}, not {me}" if owner != me else "still running"
