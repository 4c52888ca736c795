"""Exact resume at every world size (issue 21): a script shaped like pytorch/examples'
imagenet/main.py, stopped by SIGTERM mid-epoch, or SIGKILLed after a periodic save in the middle
of an epoch or at an epoch's last step, then started again, prints the same loss at every step
on every rank as the run that never stopped: 1, 2, 3 and 4 gloo ranks, loader workers 0 and 2.

With 3 or more ranks a float sum depends on its order, so this is where DDP's first step after
a resume (summed in another bucket layout) used to differ by one ulp; and a save at an epoch's
last step used to resume into an extra epoch. At 4 ranks one chain of runs meets every kind of
stop: killed after the save at an epoch's end, resumed and killed after a save in the middle of
an epoch, resumed and stopped by SIGTERM, resumed to the end. 3 ranks are killed after a save in
the middle of an epoch, 2 after the save at an epoch's end, 1 is stopped by SIGTERM."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.e2e import reference
from tests.e2e.helpers import SCRIPTS, Job, gone_within, start

pytestmark = pytest.mark.timeout(400)
SCRIPT = str(SCRIPTS / "examples_style.py")
STEPS = 15  # 3 epochs of 5 steps, at any world size
LOSS = re.compile(r"loss rank (\d) epoch (\d) step (\d+) = (\S+)")
SLOW = "0.25"  # seconds per step of a run that is to be stopped: time to stop it where meant


def losses(text: str) -> dict[tuple[int, int], tuple[int, str]]:
    """(rank, step) -> (epoch, loss) as printed."""
    return {(int(r), int(s)): (int(e), v) for r, e, s, v in LOSS.findall(text)}


def never_stopped(tmp_path, world: int) -> dict[tuple[int, int], tuple[int, str]]:
    """The run every step is compared with (tests/e2e/reference.py: the stopped job's own
    first steps are compared with it too)."""
    out = reference.never_stopped(SCRIPT, [str(tmp_path / "never"), "-j", "0"], world,
                                  tmp_path / "reference")  # fmt: skip
    found = losses(out)
    assert sorted(found) == [(r, s) for r in range(world) for s in range(1, STEPS + 1)]
    assert {e for e, _ in found.values()} == {0, 1, 2}
    return found


def launch(tmp_path, world: int, workers: int, *extra: str) -> Job:
    args = ["-n", str(world), SCRIPT, str(tmp_path / "state"), "-j", str(workers), *extra]
    return start(args, tmp_path)


def same(job: Job, expected, resumed_at: int | None, through: int | None = None) -> int:
    """Every step line of `job` equals the never-stopped run's; it resumed where it should
    and did no step twice. Returns the last step it printed."""
    if resumed_at is not None:
        assert f"resumed at step {resumed_at} " in job.stdout, job.stdout + job.stderr
    found = losses(job.stdout)
    steps = sorted({s for _, s in found})
    first = (resumed_at or 0) + 1
    assert steps == list(range(first, steps[-1] + 1)), f"steps {steps}: none twice, none lost"
    if through is not None:
        assert steps[-1] == through
    differ = sorted(k for k, v in found.items() if v != expected[k])
    assert not differ, (
        f"{len(differ)} of {len(found)} step lines differ from the never-stopped run, first "
        f"(rank, step) {differ[:3]}: {[(found[k], expected[k]) for k in differ[:3]]}"
    )
    return steps[-1]


def killed_after(job: Job, step: int) -> None:
    job.wait_for(f"loss rank 0 epoch {(step - 1) // 5} step {step} =", timeout=150)
    job.proc.send_signal(signal.SIGKILL)
    gone_within(job, 30)


def stopped_by_sigterm_after(job: Job, step: int, world: int = 1) -> int:
    job.wait_for(f"loss rank 0 epoch {(step - 1) // 5} step {step} =", timeout=150)
    state = job.log_dir / job.run_id / "state0"
    deadline = time.monotonic() + 60
    while not all((state / f"rank{r}.graceful").exists() for r in range(world)):
        assert time.monotonic() < deadline, "the ranks never read s.stop_requested"
        time.sleep(0.01)
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(60) == 143, job.stderr
    stopped = re.search(r"stopped at step (\d+), state saved", job.stdout)
    assert stopped, job.stdout + job.stderr
    assert not job.survivors()
    return int(stopped.group(1))


def test_every_kind_of_stop_resumes_exactly_at_4_ranks(tmp_path):
    world = 4
    expected = never_stopped(tmp_path, world)
    # saves every 5 steps: the last step of each epoch; killed after step 12 (saved at 10)
    first = launch(tmp_path, world, 2, "--save-every", "5", "--sleep", SLOW)
    killed_after(first, 12)
    same(first, expected, None)
    # resumed at epoch 1's end; saves every 11 steps: at 11, epoch 2's first; killed after 12
    second = launch(tmp_path, world, 0, "--save-every", "11", "--sleep", SLOW)
    killed_after(second, 12)
    same(second, expected, 10)
    # resumed in the middle of epoch 2, stopped by SIGTERM (the script saves and leaves). Sent
    # once rank 0 printed step 12 and every rank has read s.stop_requested (its first read
    # marks the rank graceful), so SIGTERM asks for a stop; before that first read it ends a
    # script at once. The ranks see it one or two steps later: 13 or 14, mid-epoch; or at 12
    # itself, the resumed job's first read, which compares at once: a rank marked graceful
    # there but not yet compared sends its flag in that first comparison
    third = launch(tmp_path, world, 2, "--sleep", SLOW)
    stopped = stopped_by_sigterm_after(third, 12, world)
    assert stopped in (12, 13, 14), "mid-epoch"
    assert same(third, expected, 11) == stopped
    last = launch(tmp_path, world, 0)
    assert last.finish(200) == 0, last.stderr
    same(last, expected, stopped, through=STEPS)


def test_one_rank_stopped_by_sigterm_mid_epoch_resumes_exactly(tmp_path):
    expected = never_stopped(tmp_path, 1)
    first = launch(tmp_path, 1, 0, "--sleep", SLOW)
    stopped = stopped_by_sigterm_after(first, 7)
    same(first, expected, None)
    last = launch(tmp_path, 1, 2)
    assert last.finish(200) == 0, last.stderr
    same(last, expected, stopped, through=STEPS)


def killed_after_a_save_then_resumed(tmp_path, world: int, save_every: int, kill_after: int):
    """Saves every `save_every` steps (loader workers 2), SIGKILLed after step `kill_after`,
    then resumed (no workers) from the last save to the end: every step as never stopped."""
    expected = never_stopped(tmp_path, world)
    first = launch(tmp_path, world, 2, "--save-every", str(save_every), "--sleep", SLOW)
    killed_after(first, kill_after)
    same(first, expected, None)
    last = launch(tmp_path, world, 0)
    assert last.finish(200) == 0, last.stderr
    same(last, expected, kill_after // save_every * save_every, through=STEPS)


def test_three_ranks_killed_after_a_save_mid_epoch_resume_exactly(tmp_path):
    # saves at 7, epoch 1's second step; killed after step 8
    killed_after_a_save_then_resumed(tmp_path, 3, save_every=7, kill_after=8)


def test_two_ranks_killed_after_a_save_at_an_epochs_last_step_resume_exactly(tmp_path):
    # saves at 5, epoch 0's last step; killed after step 7
    killed_after_a_save_then_resumed(tmp_path, 2, save_every=5, kill_after=7)
