"""`ddpkit kill JOB|PID`: end a whole training job (launcher, ranks and everything they
started): SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kill", help="end a training job's whole process tree", description=__doc__)
    p.add_argument("job", help="a job id from `ddpkit ps`, or the pid of any of its processes")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between TERM and KILL")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import psutil

    from ddpkit.errors import ConfigError
    from ddpkit.procs import list_training_processes, processes_of_job, terminate

    found = list_training_processes()
    job = args.job
    if job.isdigit() and not any(p.job == job for p in found):
        match = next((p for p in found if p.pid == int(job)), None)
        if match is None:
            if not psutil.pid_exists(int(job)):
                raise ConfigError(f"no process with pid {job}", fix="see `ddpkit ps`")
            job = None
            root = psutil.Process(int(args.job))
            targets = [root, *root.children(recursive=True)]
        else:
            job = match.job
    if job is not None:
        launchers = [psutil.Process(p.pid) for p in found if p.job == job and p.role == "launcher"]
        targets = launchers + processes_of_job(job)
        if not targets:
            raise ConfigError(f"no job {job!r} on this machine", fix="see `ddpkit ps` for jobs")
    ended = terminate(targets, args.grace)
    print(f"ended {len(ended)} process(es): " + ", ".join(str(p.pid) for p in ended))
    return 0
