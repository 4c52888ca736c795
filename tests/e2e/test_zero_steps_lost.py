"""A rank that fails costs no step (issue 38, first part): the ranks left write the state of the
last completed step, and `ddpkit run --max-restarts 1` resumes from it. The script is the
pytorch/examples ddp-tutorial-series trainer (tests/e2e/scripts/snapshot_trainer.py), saving
every 10 steps, 3 ranks; a rank fails at step 15 of the first attempt. Every step's global loss
is bit-identical to the never-failed run's, every sample of the epoch is trained on once in the
run's history, and nothing is left running."""

from __future__ import annotations

import re

import pytest

from tests.e2e.helpers import SCRIPTS, start

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "snapshot_trainer.py")
STEP = re.compile(r"\] step (\d+) loss (\S+)")
SAMPLES = re.compile(r"rank \d attempt (\d) epoch 0 step (\d+) samples ([\d,]+)")
RESUMED = re.compile(r"Resuming training from snapshot at Epoch 0 step (\d+)")


def run(tmp_path, name, *extra):
    args = ["-n", "3", "--max-restarts", "1", SCRIPT, "1", "1", "--batch_size", "4",
            "--snapshot_path", str(tmp_path / name), "--save_steps", "10", "--augment",
            *extra]  # fmt: skip
    return start(args, tmp_path)


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


def test_a_failed_rank_costs_no_step_and_every_later_loss_is_the_never_failed_runs(tmp_path):
    never = run(tmp_path, "never")
    assert never.finish(120) == 0, never.stderr
    expected = losses(never.stdout)
    assert sorted(expected) == list(range(1, 21)), "1 epoch of 20 steps of 12 samples"
    for name, failure in (("raised", ["1", "raise"]), ("killed", ["0", "kill"])):
        rank, how = failure
        job = run(tmp_path, name, "--fail_rank", rank, "--fail_step", "15", "--fail_how", how)
        assert job.finish(120) == 0, job.stderr
        said = job.stderr
        assert re.search(r"rank \d wrote the state of the last completed step to .*state-", said)
        assert "restarting the whole group (1 of 1)" in said
        resumed = int(RESUMED.search(job.stdout)[1])
        assert resumed == 14, f"{name}: steps 1-14 were complete; the last save was at 10"
        assert f"rank {rank}'s from the random streams it left at that step" in said
        assert "random state went with it" not in said, "its streams were on this node"
        got = losses(job.stdout)
        assert all(len(v) == 1 for v in got.values()), f"{name}: no step done twice"
        assert got == {step: [loss] for step, [loss] in expected.items()}, name
        assert trained_on(job.stdout, resumed) == list(range(240)), "every sample once"
        assert not job.survivors()


def test_a_failure_after_the_optimizer_step_keeps_the_last_regular_save(tmp_path):
    # the ranks left fail in the loss's all-reduce after their optimizer step: the parameters
    # are no longer the last boundary's, so nothing is written and the save at step 10 is used
    job = run(tmp_path, "after", "--fail_rank", "1", "--fail_step", "15", "--fail_where", "after")
    assert job.finish(120) == 0, job.stderr
    assert "wrote the state of the last completed step" not in job.stderr
    assert int(RESUMED.search(job.stdout)[1]) == 10
    assert not job.survivors()
