"""`ddpkit profile [JOB] --steps N`: record the same N steps of every rank of a running job
with torch's profiler, no change to the script and no restart; the job keeps training. Prints
where each rank's step goes and which rank the others wait for; writes one trace per rank and
a merged one into the job's run folder. `--at STEP` starts at that step (the same on every
node: run the command on each node of a multi-node job)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import uuid
from pathlib import Path

ARM_WITHIN = 3.0  # seconds for every rank to answer the plan (they poll every 0.2 s)
LEAD = 2.0  # seconds of steps between the plan and its first step


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="record N steps of every rank of a running job", description=__doc__
    )
    p.add_argument("job", nargs="?", help="job id from `ddpkit ps` (default: the only job)")
    p.add_argument("--steps", type=int, default=5, help="steps to record (default 5)")
    p.add_argument("--at", type=int, help="the first step to record (default: in ~2 s)")
    p.add_argument("--shapes", action="store_true", help="record input shapes (bigger traces)")
    p.add_argument("--stack", action="store_true", help="record Python stacks (bigger traces)")
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds to wait for the recording (600)"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import psutil

    from ddpkit.common import protocol
    from ddpkit.common.procs import job_workers
    from ddpkit.errors import ConfigError, LaunchError
    from ddpkit.launch import profile_breakdown

    if not 1 <= args.steps <= 1000:
        raise ConfigError(f"--steps {args.steps} is not 1 to 1000", fix="e.g. --steps 5")
    if args.at is not None and args.at < 1:
        raise ConfigError(f"--at {args.at}: steps are numbered from 1", fix="e.g. --at 100")
    job, mine = job_workers(args.job, "profile")
    state_dirs: dict[int, Path] = {}
    for p in mine:
        try:
            state_dir = psutil.Process(p.pid).environ().get(protocol.STATE_DIR)
        except psutil.Error:
            state_dir = None
        if state_dir is None:
            raise ConfigError(
                f"rank {p.rank} of job {job} (pid {p.pid}) was not started by `ddpkit run`",
                fix="start the job with `ddpkit run ...`; its ranks then answer `ddpkit profile`",
            )
        state_dirs[int(p.rank)] = Path(state_dir)
    pids = {int(p.rank): p.pid for p in mine}
    counts = _step_counts(state_dirs)
    if not counts:
        raise LaunchError(
            f"job {job} has timed no optimizer step yet (no step record on this node)",
            fix="`ddpkit profile` records optimizer steps: call it once the job trains (a job "
            "that never calls optimizer.step() has no steps to record)",
        )
    first = args.at - 1 if args.at is not None else max(counts.values()) + _lead(state_dirs)
    plan_id = uuid.uuid4().hex[:8]
    run_dir = next(iter(state_dirs.values())).parent
    folder = run_dir / f"profile-{first + 1}-{first + args.steps}"
    if folder.exists():
        folder = run_dir / f"profile-{first + 1}-{first + args.steps}-{plan_id}"
    plan = {"first": first, "steps": args.steps, "folder": str(folder), "shapes": args.shapes,
            "stack": args.stack, "id": plan_id}  # fmt: skip
    answers = _arm(plan, state_dirs, pids)
    missed = {r: a for r, a in answers.items() if not a.get("armed")}
    if missed:
        why = "; ".join(f"rank {r}: {a.get('why', 'no answer')}" for r, a in sorted(missed.items()))
        raise LaunchError(
            f"not every rank could be armed to record from step {first + 1} ({why})",
            fix="a rank past that step: give a later --at (`ddpkit top` shows the step); a rank "
            "that did not answer is blocked holding Python's lock: `ddpkit stacks` shows where",
        )
    print(
        f"ddpkit: recording steps {first + 1}-{first + args.steps} of job {job} on "
        f"{len(pids)} rank(s) (now at step {max(counts.values())})",
        flush=True,
    )
    _wait_done(plan_id, state_dirs, pids, args.timeout, first)
    merged = profile_breakdown.merge(folder)
    recordings = profile_breakdown.read(folder, state_dirs)
    report = profile_breakdown.text(recordings, folder, merged)
    (folder / "breakdown.txt").write_text(report + "\n")
    profile_breakdown.plot(recordings, folder / "breakdown.png")
    print(report)
    return 0


def _step_counts(state_dirs: dict[int, Path]) -> dict[int, int]:
    from ddpkit.common import protocol

    counts = {}
    for rank, state_dir in state_dirs.items():
        record = protocol.read_steps(state_dir, rank)
        if record is not None and record.count > 0:
            counts[rank] = record.count
    return counts


def _lead(state_dirs: dict[int, Path]) -> int:
    """Steps that take about LEAD seconds (at least 3), from the ranks' recent step times."""
    from ddpkit.common import protocol

    times = []
    for rank, state_dir in state_dirs.items():
        record = protocol.read_steps(state_dir, rank, since=0)
        if record is not None:
            times += [s.total for s in record.steps[-20:]]
    step = statistics.median(times) if times else 0.0
    return max(3, math.ceil(LEAD / step)) if step > 0 else 3


def _arm(plan: dict, state_dirs: dict[int, Path], pids: dict[int, int]) -> dict[int, dict]:
    from ddpkit.common import protocol
    from ddpkit.launch import asking
    from ddpkit.launch.wait import Wait

    for rank, state_dir in state_dirs.items():
        path = protocol.state_path(state_dir, rank, protocol.PROFILE_PLAN)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(plan))
        tmp.replace(path)
    question = asking.Question(protocol.PROFILE_ARMED, protocol.PROFILE_REQUEST)
    answers: dict[int, dict] = {}
    for state_dir in set(state_dirs.values()):
        ranks = {r: pids[r] for r, d in state_dirs.items() if d == state_dir}
        answers.update(asking.collect(question, state_dir, ranks, Wait(), ARM_WITHIN, json.loads))
    return {r: answers.get(r, {"armed": False, "why": "no answer"}) for r in state_dirs}


def _wait_done(
    plan_id: str, state_dirs: dict[int, Path], pids: dict[int, int], timeout: float, first: int
) -> None:
    """Until every rank wrote this plan's summary, or ended; a LaunchError past `timeout`."""
    import psutil

    from ddpkit.common import protocol
    from ddpkit.errors import LaunchError

    deadline = time.monotonic() + timeout
    while True:
        pending = []
        for rank, state_dir in state_dirs.items():
            try:
                done = json.loads(
                    protocol.state_path(state_dir, rank, protocol.PROFILE_DONE).read_text()
                )
            except (OSError, ValueError):
                done = {}
            if done.get("plan", {}).get("id") == plan_id:
                continue
            if not psutil.pid_exists(pids[rank]) or _zombie(pids[rank]):
                raise LaunchError(
                    f"rank {rank} ended before it recorded (the job ended before step {first + 1})",
                    fix="profile steps the job will still reach: `ddpkit top` shows where it is",
                )
            pending.append(rank)
        if not pending:
            return
        if time.monotonic() > deadline:
            counts = _step_counts(state_dirs)
            raise LaunchError(
                f"ranks {','.join(map(str, pending))} did not finish the recording within "
                f"--timeout {timeout:g} s (at step {max(counts.values(), default=0)}; it "
                f"started at step {first + 1})",
                fix="wait longer (--timeout), or record fewer steps (--steps); the ranks "
                "stop recording on their own at the last step",
            )
        time.sleep(0.2)


def _zombie(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
