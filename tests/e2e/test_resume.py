"""Stop and resume is exact: a run stopped by SIGTERM (the script saves on s.stop_requested) or
killed (periodic saves), then started again, prints the same loss at every step on every rank
as the run that never stopped. 2 gloo ranks, dropout, a shuffled loader whose 2 workers
augment with torch's RNG, SGD with momentum, a step LR schedule."""

from __future__ import annotations

import re
import signal

import pytest

from tests.e2e.helpers import SCRIPTS, gone_within, start

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(SCRIPTS / "resumable.py")
STEPS = 24  # 3 epochs of 8 steps per rank
LOSS = re.compile(r"loss rank (\d) epoch (\d) step (\d+) = (\S+)")


def losses(text: str) -> dict[tuple[int, int], str]:
    return {(int(r), int(s)): v for r, _, s, v in LOSS.findall(text)}


def run_through(tmp_path, name: str, *extra: str) -> tuple[dict[tuple[int, int], str], str]:
    job = start(["-n", "2", SCRIPT, str(tmp_path / name), *extra], tmp_path)
    assert job.finish(120) == 0, job.stderr
    assert "finished" in job.stdout
    return losses(job.stdout), job.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("a")
    found, _ = run_through(tmp, "state")
    assert sorted(found) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]
    return found


def test_a_run_stopped_by_sigterm_resumes_exactly(tmp_path, uninterrupted):
    first = start(["-n", "2", SCRIPT, str(tmp_path / "state"), "--sleep", "0.05"], tmp_path)
    first.wait_for("epoch 1 step 12 =")  # in the middle of the second epoch
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(60) == 143
    stopped = re.search(r"stopped at step (\d+), state saved", first.stdout)
    assert stopped, first.stdout + first.stderr
    before = losses(first.stdout)
    after, said = run_through(tmp_path, "state")
    assert f"resumed at step {stopped.group(1)}" in said
    for key, value in {**before, **after}.items():
        assert value == uninterrupted[key], f"rank {key[0]} step {key[1]}"
    assert set(before) | set(after) == set(uninterrupted)
    assert min(s for _, s in after) == int(stopped.group(1)) + 1, "no step done twice"
    assert not first.survivors()


def test_a_killed_run_resumes_from_its_last_periodic_save_exactly(tmp_path, uninterrupted):
    args = ["-n", "2", SCRIPT, str(tmp_path / "state"), "--sleep", "0.05", "--save-every", "5"]
    first = start(args, tmp_path)
    first.wait_for("epoch 1 step 13 =")
    first.proc.send_signal(signal.SIGKILL)
    gone_within(first, 30)
    after, said = run_through(tmp_path, "state", "--save-every", "5")
    assert "resumed at step 10" in said
    resumed_at = min(s for _, s in after) - 1
    assert resumed_at == 10, f"resumed after step {resumed_at}"
    for key, value in after.items():
        assert value == uninterrupted[key], f"rank {key[0]} step {key[1]}"
    assert {s for _, s in after} == set(range(resumed_at + 1, STEPS + 1))


def test_a_state_written_by_other_world_size_loads_the_model_but_not_the_ranks_part(tmp_path):
    from pathlib import Path

    import torch

    import ddpkit
    from ddpkit.errors import CheckpointError

    state = tmp_path / "state"
    job = start(["-n", "2", SCRIPT, str(state), "--epochs", "1", "--save-every", "8"], tmp_path)
    assert job.finish(120) == 0
    with ddpkit.setup() as s:  # one process now
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2)
        )
        with pytest.raises(CheckpointError, match="saved by 2 ranks and this job has 1"):
            s.load_state(state, model=model)
        assert s.load_state(state, model=model, rng=False)
        assert s.load_state(Path(tmp_path / "nothing"), model=model) is False
