"""What a restart cost, said in one line once the restarted job's first step ends:

    ddpkit: rank 1 failed after step 14 (exited with code 1: RuntimeError: boom); resumed after
    step 14 in 2.9 s, 0 steps lost (the state the ranks left wrote at the failure); attempt 2 of 2

The steps are the job's optimizer steps as the ranks count them across restarts
(ddpkit.train.step_count: each rank's count record, as the snapshot read it): the step the
failed rank was in, the state the restarted ranks' s.load_state went on from, and the wall
time from the failure to the end of the first step after it; steps are said as those completed
("after step 14"). A script that loads no state is told it started again from step 0, how many
steps it trains again, and how to keep them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpkit.launch.base.snapshot import Snapshot
from ddpkit.launch.report import Outcome


@dataclass(frozen=True)
class Failure:
    """The attempt that failed, as the next one needs it."""

    wall: float  # when it failed (the root rank's end; the first failed rank's otherwise)
    who: str  # "rank 1", or "the job" when the root cause is not a rank of this node
    cause: str  # what happened, short
    step: int | None  # the job's step it came in (None: no rank counted steps)
    attempt: str  # "attempt 2 of 2": the one that starts next


def failure_of(outcome: Outcome, ended: Snapshot, attempt: str) -> Failure:
    failed = [v for v in ended.ranks if v.failed and not v.stopped]
    root = next((v for v in ended.ranks if v.rank == outcome.root_rank), None)
    when = [v.ended_wall for v in ([root] if root is not None else failed) if v.ended_wall]
    known = {v.rank: v.count.base + v.count.done for v in ended.ranks if v.count is not None}
    step: int | None = None
    if root is not None and root.rank in known:
        step = known[root.rank] + 1
    elif known:
        step = max(known.values()) + 1
    who = f"rank {root.rank}" if root is not None else "the job"
    return Failure(min(when, default=ended.wall), who, _short(outcome, root), step, attempt)


def _short(outcome: Outcome, root: object) -> str:
    text = outcome.summary
    if root is not None and outcome.root_rank is not None:
        text = text.removeprefix(f"rank {outcome.root_rank} ")
    return re.sub(r" at \S+:\d+ in .*$", "", text)  # where it is in the report above


def went_on(failure: Failure, now: Snapshot) -> str | None:
    """The line, once a restarted rank of this node ended its first step; None before."""
    for view in now.ranks:
        count = view.count
        if count is None or count.done < 1 or not count.first_end:
            continue
        seconds = max(count.first_end - failure.wall, 0.0)
        # steps said as the ones completed ("after step 15"): the same number whether the
        # script counts from 0 (its step 15 is the one it failed in) or from 1
        done = failure.step - 1 if failure.step is not None else None
        came = f" after step {done}" if done is not None else ""
        head = f"{failure.who} failed{came} ({failure.cause})"
        if not count.loaded:
            again = f"its {done} steps are trained again" if done else "its steps are trained again"
            return (
                f"{head}; restarted from step 0, its first step {seconds:.1f} s after the "
                f"failure: the script loads no state, so {again} (to keep them: "
                "s.save_state every few steps and s.load_state at the start); "
                f"{failure.attempt}"
            )
        lost = f", {max(done - count.base, 0)} steps lost" if done is not None else ""
        source = (
            "the state the ranks left wrote at the failure"
            if count.rescued
            else "the last saved state"
        )
        return (
            f"{head}; resumed after step {count.base} in {seconds:.1f} s{lost} ({source}); "
            f"{failure.attempt}"
        )
    return None
