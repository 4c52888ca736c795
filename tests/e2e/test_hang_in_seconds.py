"""A hang named in seconds with no flag: the hang zoo's cases, started with `ddpkit run -n 3`
and nothing else, are each named (the rank at fault, its place) within 30 s of the stall; work
that keeps the others waiting longer than that (one rank computing, every rank warming up
before its first step, rank 0 writing a checkpoint to a slow disk, a child process
downloading) is never cut. The jobs of each test run side by side: a hung job is idle, so the
waits overlap. The window's rule from made-up looks: tests/unit/test_hang_window.py."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.e2e.helpers import SCRIPTS, Job, bound, start
from tests.e2e.test_fault_verdicts import rank_pid

pytestmark = pytest.mark.timeout(300)
HANGS = str(SCRIPTS / "hangs.py")
WITHIN = 30.0  # seconds from the stall to the verdict, with the defaults

# case -> (script and its arguments, the marker printed as it stalls, what the verdict says)
ZOO: dict[str, tuple[list[str], str, str]] = {
    "a rank asleep": ([HANGS, "sleep"], "stall", r"rank 1 is elsewhere: stuck_here"),
    "a collective on rank 0 only": (
        [HANGS, "only-rank-0"], "stall", r"the ranks called different collectives: .*barrier"),
    "an extra barrier": ([HANGS, "skipped-barrier"], "stall", r"ranks 0,2 wait in barrier"),
    "a DataLoader worker that never returns": (
        [HANGS, "loader"], "stall", r"rank 1 waits for a DataLoader batch"),
    "C code holding the GIL": (
        [str(SCRIPTS / "holds_the_gil.py")], "[rank 1] ready", r"rank 1 holds the GIL in C code"),
    "a paused rank": (
        [str(SCRIPTS / "steady.py")], "[rank 0] ready", r"rank 1 is stopped \(SIGSTOP"),
}  # fmt: skip


def first_seen(jobs: dict[str, Job], text: dict[str, str], limit: float) -> dict[str, float]:
    """When each job's output first held its text (monotonic), looked at every 0.1 s."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + limit
    while len(seen) < len(jobs) and time.monotonic() < deadline:
        for name, job in jobs.items():
            if name not in seen and any(text[name] in line for line in job.out + job.err):
                seen[name] = time.monotonic()
        time.sleep(0.1)
    return seen


def test_every_hang_of_the_zoo_is_named_within_30_s_with_no_flag(tmp_path):
    jobs = {}
    for i, (name, (args, _, _)) in enumerate(ZOO.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        jobs[name] = start(["-n", "3", "--grace", "2", *args], folder)
    try:
        stalled = first_seen(jobs, {name: marker for name, (_, marker, _) in ZOO.items()}, 120)
        assert set(stalled) == set(ZOO), {n: jobs[n].stderr for n in ZOO if n not in stalled}
        os.kill(rank_pid(jobs["a paused rank"].run_id, 1), signal.SIGSTOP)
        stalled["a paused rank"] = time.monotonic()
        said = first_seen(jobs, dict.fromkeys(ZOO, "root cause:"), bound(WITHIN) + 30)
        assert set(said) == set(ZOO), {n: jobs[n].stderr for n in ZOO if n not in said}
        for name, job in jobs.items():
            assert job.finish(60) == 124, f"{name}: {job.stderr}"
    finally:
        for job in jobs.values():
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()
    for name, job in jobs.items():
        took = said[name] - stalled[name]
        assert took < bound(WITHIN), f"{name}: named {took:.0f} s after the stall"
        cause = next(line for line in job.err if "root cause:" in line)
        assert re.search(ZOO[name][2], cause), f"{name}: {cause}"
        assert re.search(r"when: no rank did work for \d+ s; a hang after 20 s \(--hang-min\)",
                         job.stderr), job.stderr  # fmt: skip
        assert not job.survivors()


# case -> the script and its arguments; each waits 40 s, longer than --hang-min
WORK = {
    "one rank computing while the others wait": [HANGS, "compute", "40"],
    "every rank busy before its first step": [HANGS, "warm-up", "40"],
    "rank 0 writing a checkpoint to a slow disk": [HANGS, "slow-save", "40", "{folder}"],
    "a child process downloading": [str(SCRIPTS / "downloading.py"), "40", "{folder}"],
}


def test_work_that_keeps_the_others_waiting_longer_than_30_s_is_never_cut(tmp_path):
    jobs = {}
    for i, (name, args) in enumerate(WORK.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        jobs[name] = start(["-n", "3", *[a.format(folder=folder) for a in args]], folder)
    for name, job in jobs.items():
        assert job.finish(200) == 0, f"{name}: {job.stderr}"
        assert job.stdout.count("finished") == 3, f"{name}: {job.stdout}"
        assert "hung" not in job.stderr, f"{name}: {job.stderr}"
        assert not job.survivors()
