"""`ddpkit profile [JOB] --steps N`: record the same N steps of every rank of a running job
with torch's profiler, no change to the script and no restart; the job keeps training. Prints
where each rank's step goes and which rank the others wait for; writes one trace per rank and
a merged one into the job's run folder. On a job of several nodes, run it on any node: the
other nodes' launchers arm their ranks through the job's store, keep their traces in their own
run folders and send their summaries back. `--at STEP` starts at that step."""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddpkit.common.protocol import Step

LEAD = 2.0  # seconds of steps between the plan and its first step
# several nodes: the plan reaches the others at their launcher's next beat (1 s), then their
# ranks' next poll; they answer through the store
CROSS_NODE_LEAD = 3.0
OTHER_NODES_WITHIN = 10.0


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
    from ddpkit.launch.base import profile_ask

    most = protocol.MOST_PROFILE_STEPS
    if not 1 <= args.steps <= most:
        raise ConfigError(
            f"--steps {args.steps} is not 1 to {most} (every op of every recorded step is held "
            "in the ranks' memory until the last one)",
            fix="e.g. --steps 5; to follow a job longer, record a few steps at a time",
        )
    if args.at is not None and args.at < 1:
        raise ConfigError(f"--at {args.at}: steps are numbered from 1", fix="e.g. --at 100")
    job, mine = job_workers(args.job, "profile")
    state_dirs: dict[int, Path] = {}
    nodes = Nodes()
    for p in mine:
        try:
            env = psutil.Process(p.pid).environ()
        except psutil.Error:
            env = {}
        if protocol.STATE_DIR not in env:
            raise ConfigError(
                f"rank {p.rank} of job {job} (pid {p.pid}) was not started by `ddpkit run`",
                fix="start the job with `ddpkit run ...`; its ranks then answer `ddpkit profile`",
            )
        state_dirs[int(p.rank)] = Path(env[protocol.STATE_DIR])
        nodes = Nodes(int(env.get("GROUP_RANK", 0)), int(env.get("GROUP_WORLD_SIZE", 1)))
    pids = {int(p.rank): p.pid for p in mine}
    counts = _step_counts(state_dirs)
    if not counts:
        raise LaunchError(
            f"job {job} has timed no optimizer step yet (no step record on this node)",
            fix="`ddpkit profile` records optimizer steps: call it once the job trains (a job "
            "that never calls optimizer.step() has no steps to record)",
        )
    lead = _lead(state_dirs, CROSS_NODE_LEAD if nodes.others else 0.0)
    first = args.at - 1 if args.at is not None else max(counts.values()) + lead
    plan_id = uuid.uuid4().hex[:8]
    run_dir = next(iter(state_dirs.values())).parent
    folder = run_dir / f"profile-{first + 1}-{first + args.steps}"
    if folder.exists():
        folder = run_dir / f"profile-{first + 1}-{first + args.steps}-{plan_id}"
    plan = {"first": first, "steps": args.steps, "folder": str(folder), "shapes": args.shapes,
            "stack": args.stack, "id": plan_id}  # fmt: skip
    if nodes.others:  # every other node's launcher arms its ranks too (peers.profile_relay)
        _hand_to_launcher(run_dir, {**plan, "origin": nodes.me, "timeout": args.timeout})
    answers: dict[int | str, dict] = {}
    for rank, answer in profile_ask.arm(plan, state_dirs, pids).items():
        answers[rank] = answer
    answers.update(_other_nodes_armed(folder, nodes))
    missed = {r: a for r, a in answers.items() if not a.get("armed")}
    if missed:
        said = sorted(missed.items(), key=lambda item: str(item[0]))
        why = "; ".join(f"{_who(r)}: {a.get('why', 'no answer')}" for r, a in said)
        raise LaunchError(
            f"not every rank could be armed to record from step {first + 1} ({why})",
            fix="a rank past that step: give a later --at (`ddpkit top` shows the step); a rank "
            "that did not answer is blocked holding Python's lock: `ddpkit stacks` shows where; "
            "a node that did not answer: its launcher is older or its link to node 0 is down",
        )
    print(
        f"ddpkit: recording steps {first + 1}-{first + args.steps} of job {job} on "
        f"{len(answers)} rank(s){nodes.words()} (now at step {max(counts.values())})",
        flush=True,
    )
    # SIGINT cuts the recording however the command was started: a shell's background job (a
    # script's `ddpkit profile ... &`, CI's) inherits SIGINT ignored, and Python keeps that
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _wait_done(plan_id, state_dirs, pids, args.timeout, first, folder, nodes)
    except KeyboardInterrupt:  # Ctrl+C: the recording ends at the ranks' next step
        now = max(_step_counts(state_dirs).values(), default=first)
        cut = {**plan, "steps": max(0, now + 1 - first)}
        if nodes.others:
            _hand_to_launcher(run_dir, {**cut, "origin": nodes.me, "timeout": args.timeout})
        profile_ask.arm(cut, state_dirs, pids)
        outcome = (
            f"the ranks stop recording at step {now + 1} and write what they recorded into {folder}"
            if now >= first
            else "nothing was recorded"
        )
        print(f"\nddpkit: stopped (Ctrl+C) at step {now}: {outcome}; the job goes on", flush=True)
        return 130
    merged = profile_breakdown.merge(folder)
    recordings = profile_breakdown.read(folder, _timed_steps(state_dirs))
    print(profile_breakdown.write(recordings, folder, merged))
    return 0


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as this node's ranks know them."""

    me: int = 0
    count: int = 1

    @property
    def others(self) -> list[int]:
        return [n for n in range(self.count) if n != self.me]

    def words(self) -> str:
        return f" of {self.count} nodes" if self.count > 1 else ""


def _who(key: int | str) -> str:
    return f"rank {key}" if isinstance(key, int) else str(key)


def _hand_to_launcher(run_dir: Path, plan: dict) -> None:
    from ddpkit.launch.peers.profile_relay import ASK_FILE

    tmp = run_dir / (ASK_FILE + ".tmp")
    tmp.write_text(json.dumps(plan))
    tmp.replace(run_dir / ASK_FILE)


def _other_nodes_armed(folder: Path, nodes: Nodes) -> dict[int | str, dict]:
    """Every other node's ranks' answers, as their launchers sent them; a node silent past
    OTHER_NODES_WITHIN is one entry of its own."""
    from ddpkit.launch.base.profile_ask import armed_file

    answers: dict[int | str, dict] = {}
    waiting = set(nodes.others)
    deadline = time.monotonic() + OTHER_NODES_WITHIN
    while waiting and time.monotonic() < deadline:
        for n in sorted(waiting):
            try:
                record = json.loads(armed_file(folder, n).read_text())
            except (OSError, ValueError):
                continue
            answers.update({int(r): a for r, a in record["answers"].items()})
            waiting.discard(n)
        time.sleep(0.1)
    for n in sorted(waiting):
        answers[f"node {n}"] = {
            "armed": False,
            "why": f"no answer within {OTHER_NODES_WITHIN:g} s through the job's store",
        }
    return answers


def _step_counts(state_dirs: dict[int, Path]) -> dict[int, int]:
    from ddpkit.common import protocol

    counts = {}
    for rank, state_dir in state_dirs.items():
        record = protocol.read_steps(state_dir, rank)
        if record is not None and record.count > 0:
            counts[rank] = record.count
    return counts


def _timed_steps(state_dirs: dict[int, Path]) -> dict[int, list[Step]]:
    """Each rank's whole step ring (this node's ranks)."""
    from ddpkit.common import protocol

    rings = {
        rank: protocol.read_steps(folder, rank, since=0) for rank, folder in state_dirs.items()
    }
    return {rank: ring.steps for rank, ring in rings.items() if ring is not None}


def _lead(state_dirs: dict[int, Path], extra: float) -> int:
    """Steps that take about LEAD (+ `extra`) seconds, at least 3, from the ranks' recent step
    times."""
    times = [s.total for steps in _timed_steps(state_dirs).values() for s in steps[-20:]]
    step = statistics.median(times) if times else 0.0
    return max(3, math.ceil((LEAD + extra) / step)) if step > 0 else 3


def _wait_done(
    plan_id: str,
    state_dirs: dict[int, Path],
    pids: dict[int, int],
    timeout: float,
    first: int,
    folder: Path,
    nodes: Nodes,
) -> None:
    """Until every rank of every node wrote this plan's summary; a LaunchError when one ended
    before it did, or past `timeout`."""
    from ddpkit.errors import LaunchError
    from ddpkit.launch.base import profile_ask

    deadline = time.monotonic() + timeout
    while True:
        seen = profile_ask.look(plan_id, state_dirs, pids)
        ended, pending = list(seen.ended), [str(r) for r in seen.pending]
        for n in nodes.others:
            try:
                record = json.loads(profile_ask.done_file(folder, n).read_text())
            except (OSError, ValueError):
                pending.append(f"node {n}'s")
                continue
            ended += record.get("ended", [])
            pending += [str(r) for r in record.get("pending", [])]
        if ended:
            raise LaunchError(
                f"rank {ended[0]} ended before it recorded (the job ended before step {first + 1})",
                fix="profile steps the job will still reach: `ddpkit top` shows where it is",
            )
        if not pending:
            return
        if time.monotonic() > deadline:
            counts = _step_counts(state_dirs)
            raise LaunchError(
                f"ranks {','.join(pending)} did not finish the recording within "
                f"--timeout {timeout:g} s (at step {max(counts.values(), default=0)}; it "
                f"started at step {first + 1})",
                fix="wait longer (--timeout), or record fewer steps (--steps); the ranks "
                "stop recording on their own at the last step",
            )
        time.sleep(0.2)
