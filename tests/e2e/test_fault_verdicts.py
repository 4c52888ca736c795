"""The rank at fault is named, not its victims, for the faults users meet (issue 27), at 3
ranks: a rank holding the GIL in C code, a stopped rank, a rank the others wait for (said once
while the job goes on; the root cause when the group's timeout ends it), a rank that runs out
of batches, a segfault, an abort, a DataLoader worker's exception, the kernel's OOM killer.
Nothing is left running after any of them.

Rank 0 serves the job's store, so a fault there is run where it changes what happens: stopped
(the store stops with it), out of batches (the store ends with it), evaluating alone; the other
faults are run once, and that the verdicts name any rank, 0 included, is in the decision tables
(tests/unit/test_blame.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.helpers import (
    SCRIPTS,
    bound,
    memory_limited_cgroup,
    start,
)

pytestmark = pytest.mark.timeout(240)


def run_to_end(tmp_path, *args: str, timeout: float = 120):
    job = start(["-n", "3", "--grace", "2", *args], tmp_path)
    code = job.finish(bound(timeout))
    assert not job.survivors(), "a process of the job is still running"
    return code, job


def root_cause(job) -> str:
    found = re.search(r"root cause: (.*)", job.stderr)
    assert found, job.stderr
    return found.group(1)


@pytest.mark.parametrize("stuck", [1])
def test_a_rank_holding_the_gil_in_c_code_is_caught_and_placed(tmp_path, stuck):
    script = str(SCRIPTS / "catastrophic_regex.py")
    code, job = run_to_end(tmp_path, "--hang-timeout", "4", script, str(stuck))
    assert code == 124, job.stderr
    cause = root_cause(job)
    assert re.search(rf"rank {stuck} holds the GIL in C code for \d+ s: match "
                     r"\(catastrophic_regex\.py:16\)", cause), cause  # fmt: skip
    others = sorted({0, 1, 2} - {stuck})
    assert f"ranks {others[0]},{others[1]} wait in all_reduce" in cause, cause


def rank_pid(run_id: str, rank: int, timeout: float = 30) -> int:
    """The pid of a rank of a running job (its bootstrap process)."""
    from ddpkit.common.procs import processes_of_job

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in processes_of_job(run_id):
            try:
                if "ddpkit.rank.bootstrap" in p.cmdline() and p.environ().get("RANK") == str(rank):
                    return p.pid
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} in job {run_id}")


@pytest.mark.parametrize("paused", [0])
def test_a_stopped_rank_is_named_as_stopped_with_how_to_resume_it(tmp_path, paused):
    job = start(["-n", "3", "--grace", "2", "--hang-timeout", "4",
                 str(SCRIPTS / "steady.py")], tmp_path)  # fmt: skip
    job.wait_for("[rank 0] ready")
    pid = rank_pid(job.run_id, paused)
    os.kill(pid, signal.SIGSTOP)
    assert job.finish(bound(60)) == 124, job.stderr
    cause = root_cause(job)
    assert f"rank {paused} is stopped (SIGSTOP, SIGTSTP or Ctrl+Z; `kill -CONT {pid}`" in cause
    assert "gave no stack" not in job.stderr
    assert not job.survivors()


def test_a_long_wait_for_a_working_rank_is_said_once_and_the_job_goes_on(tmp_path):
    # rank 2 evaluates alone, then rank 0: two episodes, each said once, naming its own rank
    script = str(SCRIPTS / "evaluates_alone.py")
    code, job = run_to_end(tmp_path, "--hang-timeout", "4", script, "2,0", "12")
    assert code == 0, job.stderr
    notes = [line for line in job.err if "not a hang, the job goes on" in line]
    assert len(notes) == 2, job.stderr
    for note, evaluator in zip(notes, (2, 0), strict=True):
        others = sorted({0, 1, 2} - {evaluator})
        assert f"ranks {others[0]},{others[1]} wait in all_reduce (evaluates_alone.py:33)" in note
        assert f"rank {evaluator} is elsewhere: evaluate (evaluates_alone.py:24)" in note
        assert "The process group's timeout (gloo, 1800 s) ends the job at" in note


@pytest.mark.parametrize("evaluator", [1])
def test_the_rank_the_others_timed_out_waiting_for_is_the_root_cause(tmp_path, evaluator):
    script = str(SCRIPTS / "evaluates_alone.py")
    code, job = run_to_end(tmp_path, "--hang-timeout", "30", script, str(evaluator), "40", "6")
    assert code == 1, job.stderr
    cause = root_cause(job)
    others = sorted({0, 1, 2} - {evaluator})
    assert cause.startswith(
        f"rank {evaluator} kept the others waiting: it was at evaluate (evaluates_alone.py:24) "
        f"when ranks {others[0]},{others[1]} timed out waiting for it in all_reduce"
    ), cause
    assert f"victim: rank {others[0]}: RuntimeError: Timed out waiting 6000ms" in job.stderr
    notes = [line for line in job.err if "not a hang, the job goes on" in line]
    assert len(notes) == 1, "said before the group's timeout ended the job (at half of it)"
    assert "(gloo, 6 s)" in notes[0]


@pytest.mark.parametrize("short", [0])
def test_a_rank_that_runs_out_of_batches_is_the_root_cause_not_its_victims(tmp_path, short):
    code, job = run_to_end(tmp_path, str(SCRIPTS / "runs_out.py"), str(short))
    assert code == 1, job.stderr
    cause = root_cause(job)
    others = sorted({0, 1, 2} - {short})
    assert cause.startswith(
        f"rank {short} ended (exit code 0) while ranks {others[0]},{others[1]} still waited"
    ), cause
    assert "uneven inputs" in cause
    assert "fix: give every rank the same number of batches: s.loader" in job.stderr
    assert f"victim: rank {others[0]}: RuntimeError: Connection closed by peer" in job.stderr
    assert "step times per rank" not in job.stderr, "no step table after a failed run"


@pytest.mark.parametrize(
    ("how", "culprit", "expected"),
    [
        ("segfault", 1, r"rank 1 died of SIGSEGV at dies_hard\.py:24 in read_null"),
        ("abort", 2, r"rank 2 died of SIGABRT at dies_hard\.py:35"),
        (
            "loader",
            1,
            r"rank 1 exited with code 1 \(ValueError in DataLoader worker \d: sample 5 is "
            r"corrupt\) at dies_hard\.py:19 in __getitem__",
        ),
    ],
)
def test_a_crash_names_the_line_it_died_at_and_the_workers_own_error(
    tmp_path, how, culprit, expected
):
    code, job = run_to_end(tmp_path, str(SCRIPTS / "dies_hard.py"), how, str(culprit))
    assert code != 0
    assert re.match(expected, root_cause(job)), job.stderr


@pytest.mark.parametrize("eater", [1])
def test_a_rank_killed_by_the_oom_killer_is_named_as_out_of_memory(tmp_path, eater):
    with memory_limited_cgroup(3 * 2**30) as cgroup:
        # the launcher starts inside the limited cgroup, as a pod's or a SLURM job's does
        cmd = (
            f"echo $$ > {cgroup}/cgroup.procs && exec {sys.executable} -m ddpkit run -n 3 "
            f"--grace 2 --log-dir {tmp_path}/logs {SCRIPTS / 'eats_memory.py'} {eater}"
        )
        done = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=180)
        assert done.returncode == 137, done.stderr
        cause = re.search(r"root cause: (.*)", done.stderr).group(1)
        assert cause.startswith(
            f"rank {eater} was killed by the kernel's OOM killer: the job's memory cgroup "
            "(limit 3 GiB) ran out of memory; its processes last held"
        ), done.stderr
        assert "fix: use less host memory per rank" in done.stderr


@pytest.mark.parametrize(
    ("case", "culprit", "fix"),
    [
        ("unused", 2, "fix: parameters 4 5 (aux.weight, aux.bias) got no gradient on rank"),
        ("differs", 1, "fix: rank 1 built a different model: its parameter 4 (aux.weight)"),
    ],
)
def test_ddp_errors_a_user_can_fix_get_a_fix_line_with_names(tmp_path, case, culprit, fix):
    code, job = run_to_end(tmp_path, str(SCRIPTS / "ddp_mistakes.py"), case)
    assert code == 1
    assert fix in job.stderr
    if case == "differs":
        assert root_cause(job).startswith(f"rank {culprit} exited with code 1"), job.stderr
