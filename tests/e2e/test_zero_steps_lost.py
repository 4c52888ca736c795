"""A rank that fails costs no step (issue 38, first part): the ranks left write the state of the
last completed step, and `ddpkit run --max-restarts 1` resumes from it. The script is the
pytorch/examples ddp-tutorial-series trainer (tests/e2e/scripts/snapshot_trainer.py), saving
every 10 steps, 3 ranks, drawing from every random stream each step (--augment); rank 1 or rank
0 fails at step 15 of the first attempt: an exception, SIGKILL, a segfault, an exit code, the
kernel's OOM killer. Every step's global loss is bit-identical to the never-failed run's, every
sample of the epoch is trained on once in the run's history, and nothing is left running. (A
lost node: tests/multinode/test_nodes.py.)"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    SCRIPTS,
    limit_memory,
    memory_cgroup_for_test,
    remove_cgroup,
    start,
)

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "snapshot_trainer.py")
STRESS = Path(__file__).parents[2] / "benchmarks" / "rescue_stress.py"
STEP = re.compile(r"\] step (\d+) loss (\S+)")
SAMPLES = re.compile(r"rank \d attempt (\d) epoch 0 step (\d+) samples ([\d,]+)")
RESUMED = re.compile(r"Resuming training from snapshot at Epoch 0 step (\d+)")


def run(tmp_path, name, *extra, cgroup=None):
    args = ["-n", "3", "--max-restarts", "1", SCRIPT, "1", "1", "--batch_size", "4",
            "--snapshot_path", str(tmp_path / name), "--save_steps", "10", "--augment",
            *extra]  # fmt: skip
    return start(args, tmp_path, cgroup=cgroup)


def losses(text: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for step, loss in STEP.findall(text):
        found.setdefault(int(step), []).append(loss)
    return found


def trained_on(text: str, resumed_at: int) -> list[int]:
    """The epoch's samples in the run's history: the first attempt's steps up to the state the
    second resumed from, then every step of the second."""
    seen = []
    for attempt, step, ids in SAMPLES.findall(text):
        if attempt == "1" or int(step) <= resumed_at:
            seen += [int(i) for i in ids.split(",")]
    return sorted(seen)


@pytest.fixture(scope="module")
def never(tmp_path_factory):
    """The never-failed run's losses, step by step."""
    tmp_path = tmp_path_factory.mktemp("never")
    job = run(tmp_path, "never")
    assert job.finish(120) == 0, job.stderr
    expected = losses(job.stdout)
    assert sorted(expected) == list(range(1, 21)), "1 epoch of 20 steps of 12 samples"
    return expected


@pytest.fixture
def cgroup_for(request):
    """A memory cgroup of 4 GiB for the OOM case (the job and its warm spares hold ~2 GiB),
    else None."""
    if request.node.callspec.params["how"] != "oom":
        yield None
        return
    cgroup = memory_cgroup_for_test()
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (needs root and the memory controller)")
    limit_memory(cgroup, 4 * 2**30)
    yield cgroup
    remove_cgroup(cgroup)


CAUSE = {  # the root cause the launcher names: the failure was the kind asked for
    "raise": "RuntimeError: boom at step 15",
    "kill": "SIGKILL",
    "segfault": "died of SIGSEGV",
    "exit": "exited with code 3",
    "oom": "killed by the kernel's OOM killer",
}


@pytest.mark.parametrize("rank", [1, 0])
@pytest.mark.parametrize("how", ["raise", "kill", "segfault", "exit", "oom"])
def test_a_failed_rank_costs_no_step_and_every_later_loss_is_the_never_failed_runs(
    tmp_path, never, how, rank, cgroup_for
):
    args = ["--fail_rank", str(rank), "--fail_step", "15", "--fail_how", how]
    job = run(tmp_path, "state", *args, cgroup=cgroup_for)
    assert job.finish(120) == 0, job.stderr
    said = job.stderr
    assert re.search(rf"root cause: rank {rank} .*{CAUSE[how]}", said), said
    assert re.search(r"rank \d wrote the state of the last completed step to .*state-", said)
    assert "restarting the whole group (1 of 1)" in said
    assert re.search(
        rf"ddpkit: rank {rank} failed at step 15 \(.*\); restarted from step 15 in [\d.]+ s, "
        r"0 steps lost \(the state the ranks left wrote at the failure\); attempt 2 of 2",
        said,
    ), said
    resumed = int(RESUMED.search(job.stdout)[1])
    assert resumed == 14, "steps 1-14 were complete; the last save was at 10"
    assert f"rank {rank}'s from the random streams it left at that step" in said
    assert "random state went with it" not in said, "its streams were on this node"
    got = losses(job.stdout)
    assert all(len(v) == 1 for v in got.values()), "no step done twice"
    assert got == {step: [loss] for step, [loss] in never.items()}
    assert trained_on(job.stdout, resumed) == list(range(240)), "every sample once"
    assert not job.survivors()


def test_a_killed_rank_whose_dataloader_workers_hold_its_connections_costs_no_step(tmp_path, never):
    # `-j 2`, as pytorch/examples' scripts take it: rank 1's forked DataLoader workers hold its
    # connections to its peers, so the ranks left are never told it died (as under NCCL, whose
    # collective with a lost peer never returns): the launcher asks them to write
    args = ["--fail_rank", "1", "--fail_step", "15", "--fail_how", "kill", "-j", "2"]
    job = run(tmp_path, "state", *args)
    assert job.finish(120) == 0, job.stderr
    assert re.search(r"rank \d wrote the state of the last completed step to .*state-", job.stderr)
    assert re.search(r"restarted from step 15 in [\d.]+ s, 0 steps lost", job.stderr), job.stderr
    assert int(RESUMED.search(job.stdout)[1]) == 14
    got = losses(job.stdout)
    assert got == {step: [loss] for step, [loss] in never.items()}
    assert trained_on(job.stdout, 14) == list(range(240)), "every sample once"
    assert not job.survivors()


def test_a_failure_after_the_optimizer_step_keeps_the_last_regular_save(tmp_path):
    # the ranks left fail in the loss's all-reduce after their optimizer step: the parameters
    # are no longer the last boundary's, so nothing is written and the save at step 10 is used
    job = run(tmp_path, "after", "--fail_rank", "1", "--fail_step", "15", "--fail_where", "after")
    assert job.finish(120) == 0, job.stderr
    assert "wrote the state of the last completed step" not in job.stderr
    assert re.search(
        r"ddpkit: rank 1 failed at step 16 \(.*\); restarted from step 11 in [\d.]+ s, 5 steps "
        r"lost \(the last saved state\); attempt 2 of 2",
        job.stderr,
    ), job.stderr
    assert int(RESUMED.search(job.stdout)[1]) == 10
    assert not job.survivors()


def test_kills_at_random_moments_resume_exactly_or_from_a_save_with_the_reason():
    # a few runs of the stress (benchmarks/rescue_stress.py: 50 before an issue is resolved),
    # a new seed each CI run: a random rank SIGKILLed at a random moment, drawing random numbers
    seed = random.randrange(10**6)
    done = subprocess.run(
        [sys.executable, str(STRESS), "--runs", "3", "--seed", str(seed), "--sleep", "0.05"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, f"seed {seed}:\n{done.stdout}\n{done.stderr[-3000:]}"
