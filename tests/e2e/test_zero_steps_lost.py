"""A rank that fails costs no step (issue 38, first part): the ranks left write the state of the
last completed step, and `ddpkit run --max-restarts 1` resumes from it. The script is the
pytorch/examples ddp-tutorial-series trainer (tests/e2e/scripts/snapshot_trainer.py), saving
every 10 steps, 3 ranks, drawing from every random stream each step (--augment); rank 1 or rank
0 fails: an exception, SIGKILL, a segfault, an exit code, the kernel's OOM killer, one in each
attempt of one job (a restart costs seconds, a new job tens). Every step's global loss is
bit-identical to the never-failed run's, every sample of the epoch is trained on once in the
run's history, and nothing is left running. (A lost node: tests/multinode/test_nodes.py. A
random rank killed at a random moment, many times: benchmarks/rescue_stress.py, a benchmark with
its results kept, not a test.)"""

from __future__ import annotations

import re

import pytest

from tests.e2e.helpers import (
    SCRIPTS,
    memory_limited_cgroup,
    start,
)

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "snapshot_trainer.py")
STEP = re.compile(r"\] step (\d+) loss (\S+)")
SAMPLES = re.compile(r"rank \d attempt (\d) epoch 0 step (\d+) samples ([\d,]+)")
RESUMED = re.compile(r"Resuming training from snapshot at Epoch 0 step (\d+)")


def run(tmp_path, name, *extra, cgroup=None, restarts=1):
    args = ["-n", "3", "--max-restarts", str(restarts), SCRIPT, "1", "1", "--batch_size", "4",
            "--snapshot_path", str(tmp_path / name), "--save_steps", "10", "--augment",
            *extra]  # fmt: skip
    return start(args, tmp_path, cgroup=cgroup)


def losses(text: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for step, loss in STEP.findall(text):
        found.setdefault(int(step), []).append(loss)
    return found


def trained_on(text: str, resumed_at: list[int]) -> list[int]:
    """The epoch's samples in the run's history: each attempt's steps up to the state the next
    one resumed from, then every step of the last."""
    seen = []
    for attempt, step, ids in SAMPLES.findall(text):
        a = int(attempt)
        if a >= len(resumed_at) or int(step) <= resumed_at[a]:
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


CAUSE = {  # the root cause the launcher names: the failure was the kind asked for
    "raise": r"RuntimeError: boom at step \d+",
    "kill": "SIGKILL",
    "segfault": "died of SIGSEGV",
    "exit": "exited with code 3",
    "oom": "killed by the kernel's OOM killer",
}


def failures_in_turn(tmp_path, never, failures, cgroup=None):
    """One job, one failure in each attempt in turn, (rank, step, how) each: every one costs no
    step, and every step's loss is the never-failed run's. One job for all of them: a restart
    costs seconds where a new job costs tens."""
    ranks, steps, hows = (",".join(str(f[i]) for f in failures) for i in range(3))
    args = ["--fail_rank", ranks, "--fail_step", steps, "--fail_how", hows]
    job = run(tmp_path, "state", *args, cgroup=cgroup, restarts=len(failures))
    assert job.finish(240) == 0, job.stderr
    said, total = job.stderr, len(failures) + 1
    for attempt, (rank, step, how) in enumerate(failures, start=2):
        assert re.search(rf"root cause: rank {rank} .*{CAUSE[how]}", said), (how, said)
        assert re.search(
            rf"ddpkit: rank {rank} failed after step {step - 1} \(.*\); resumed after step "
            rf"{step - 1} in "
            rf"[\d.]+ s, 0 steps lost \(the state the ranks left wrote at the failure\); "
            rf"attempt {attempt} of {total}",
            said,
        ), (how, rank, said)
        assert f"rank {rank}'s from the random streams it left at that step" in said
    assert len(re.findall(r"rank \d wrote the state of the last completed step to", said)) == len(
        failures
    )
    assert "random state went with it" not in said, "its streams were on this node"
    resumed = [int(n) for n in RESUMED.findall(job.stdout)]
    assert resumed == [step - 1 for _, step, _ in failures], "each at the last complete step"
    got = losses(job.stdout)
    assert all(len(v) == 1 for v in got.values()), "no step done twice"
    assert got == {step: [loss] for step, [loss] in never.items()}
    assert trained_on(job.stdout, resumed) == list(range(240)), "every sample once"
    assert not job.survivors()


def test_each_failure_kind_on_rank_1_then_rank_0_costs_no_step_and_every_loss_is_never_failed(
    tmp_path, never
):
    # steps 1-10, then the save at 10, then 11-20: each failure comes after at least one step
    # past the state the attempt began from (else that state is already the last step)
    failures = [(1, 3, "raise"), (0, 5, "raise"), (1, 7, "kill"), (0, 9, "kill"),
                (1, 13, "segfault"), (0, 15, "segfault"),
                (1, 17, "exit"), (0, 19, "exit")]  # fmt: skip
    failures_in_turn(tmp_path, never, failures)


def test_the_kernels_oom_killer_on_rank_1_then_on_rank_0_costs_no_step(tmp_path, never):
    # a memory cgroup of 4 GiB (the job and its warm spares hold ~2 GiB): the failing rank
    # allocates until the kernel's OOM killer ends it
    with memory_limited_cgroup(4 * 2**30) as cgroup:
        failures_in_turn(tmp_path, never, [(1, 5, "oom"), (0, 15, "oom")], cgroup=cgroup)


def test_a_killed_rank_whose_dataloader_workers_hold_its_connections_costs_no_step(tmp_path, never):
    # `-j 2`, as pytorch/examples' scripts take it: rank 1's forked DataLoader workers hold its
    # connections to its peers, so the ranks left are never told it died (as under NCCL, whose
    # collective with a lost peer never returns): the launcher asks them to write
    args = ["--fail_rank", "1", "--fail_step", "15", "--fail_how", "kill", "-j", "2"]
    job = run(tmp_path, "state", *args)
    assert job.finish(120) == 0, job.stderr
    assert re.search(r"rank \d wrote the state of the last completed step to .*state-", job.stderr)
    assert re.search(r"resumed after step 14 in [\d.]+ s, 0 steps lost", job.stderr), job.stderr
    assert int(RESUMED.search(job.stdout)[1]) == 14
    got = losses(job.stdout)
    assert got == {step: [loss] for step, [loss] in never.items()}
    assert trained_on(job.stdout, [14]) == list(range(240)), "every sample once"
    assert not job.survivors()


def test_a_failure_after_the_optimizer_step_keeps_the_last_regular_save(tmp_path):
    # the ranks left fail in the loss's all-reduce after their optimizer step: the parameters
    # are no longer the last boundary's, so nothing is written and the save at step 10 is used
    job = run(tmp_path, "after", "--fail_rank", "1", "--fail_step", "15", "--fail_where", "after")
    assert job.finish(120) == 0, job.stderr
    assert "wrote the state of the last completed step" not in job.stderr
    assert re.search(
        r"ddpkit: rank 1 failed after step 15 \(.*\); resumed after step 10 in [\d.]+ s, 5 steps "
        r"lost \(the last saved state\); attempt 2 of 2",
        job.stderr,
    ), job.stderr
    assert int(RESUMED.search(job.stdout)[1]) == 10
    assert not job.survivors()
