"""A job stopped by SIGTERM on 4 ranks goes on with `ddpkit run -n 3` (issue 37): the script, in
the shape of pytorch/examples' ddp-tutorial-series trainer, loads its snapshot with no change;
every sample of each epoch is trained on once across the stop, every later step's global loss is
the never-stopped 4-rank run's (the global batch of 12 is kept: 4 per rank), and the launcher's
output says what followed and what was re-seeded."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.e2e.helpers import SCRIPTS, start

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "snapshot_trainer.py")
SAMPLES = re.compile(r"rank (\d) attempt \d epoch (\d) step \d+ samples ([\d,]+)")
STEP = re.compile(r"step (\d+) loss (\S+)")


def run(tmp_path, world, snapshot, *extra):
    args = ["-n", str(world), SCRIPT, "2", "1", "--batch_size", "3", "--snapshot_path",
            str(tmp_path / snapshot), *extra]  # fmt: skip
    return start(args, tmp_path)


def seen(text: str) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for _, epoch, ids in SAMPLES.findall(text):
        found.setdefault(int(epoch), []).extend(int(i) for i in ids.split(","))
    return found


def losses(text: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP.findall(text)}


def test_a_job_stopped_on_4_ranks_goes_on_with_3(tmp_path):
    never = run(tmp_path, 4, "never")
    assert never.finish(120) == 0, never.stderr
    expected = losses(never.stdout)
    assert sorted(expected) == list(range(1, 41)), "2 epochs of 20 steps of 12 samples"

    first = run(tmp_path, 4, "snapshot", "--sleep", "0.3")
    first.wait_for("step 3 loss", timeout=120)
    state = first.log_dir / first.run_id / "state0"
    deadline = time.monotonic() + 60
    while not all((state / f"rank{r}.graceful").exists() for r in range(4)):
        assert time.monotonic() < deadline, "the ranks never read s.stop_requested"
        time.sleep(0.01)
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(60) == 143, first.stderr
    stopped = int(re.search(r"stopped at step (\d+), snapshot saved", first.stdout).group(1))
    assert 3 <= stopped < 20, "mid-epoch 0"
    assert not first.survivors()

    second = run(tmp_path, 3, "snapshot")
    assert second.finish(120) == 0, second.stderr
    said = second.stdout + second.stderr
    assert "was saved by 4 ranks; this job has 3" in said
    assert f"continues epoch 0 in the same order, {240 - 12 * stopped} samples left" in said
    assert "global batch 12 kept: 4 per rank (was 3)" in said
    assert "re-seeds them from (seed 0" in said
    assert not second.survivors()

    before, after = seen(first.stdout), seen(second.stdout)
    for epoch in (0, 1):
        both = before.get(epoch, []) + after.get(epoch, [])
        assert sorted(both) == list(range(240)), f"epoch {epoch}: every sample once"
    found = {**losses(first.stdout), **losses(second.stdout)}
    assert sorted(found) == list(range(1, 41))
    for step, loss in expected.items():
        assert found[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
