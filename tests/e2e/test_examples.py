"""The examples the docs' snippets are taken from run as a reader runs them: `ddpkit run -n 2
examples/X.py` from a folder of their own, with nothing left running."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import bound, start

pytestmark = pytest.mark.timeout(300)
EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_training_example_learns_the_digits_on_two_ranks(tmp_path):
    job = start(["-n", "2", str(EXAMPLES / "train.py")], tmp_path)
    assert job.finish(bound(120)) == 0, job.stderr
    accuracy = float(re.search(r"held-out accuracy: (\d\.\d+)", job.stdout).group(1))
    assert accuracy > 0.85, job.stdout
    assert (tmp_path / "ckpt.pt").exists()
    assert not job.survivors()


def test_the_accumulation_example_trains(tmp_path):
    job = start(["-n", "2", str(EXAMPLES / "accumulate.py")], tmp_path)
    assert job.finish(bound(120)) == 0, job.stderr
    losses = [float(x) for x in re.findall(r"epoch \d: last loss (\d+\.\d+)", job.stdout)]
    assert len(losses) == 3, job.stdout
    assert losses[-1] < losses[0]


def test_the_resume_example_stopped_goes_on_where_it_was(tmp_path):
    job = start(["-n", "2", str(EXAMPLES / "resume.py")], tmp_path)
    job.wait_for("training from step 0", bound(60))
    deadline = time.monotonic() + bound(60)
    while not list((tmp_path / "ckpt").glob("state-*")):  # its first save, at step 100
        assert job.proc.poll() is None or list((tmp_path / "ckpt").glob("state-*")), job.stderr
        assert time.monotonic() < deadline, job.stderr
        time.sleep(0.01)
    job.proc.send_signal(signal.SIGTERM)
    job.finish(bound(60))
    stopped = re.search(r"stopped at step (\d+), state saved", job.stdout)
    kept = int(stopped.group(1)) if stopped else 230  # or it had ended (and saved) before
    again = start(["-n", "2", str(EXAMPLES / "resume.py")], tmp_path)
    assert again.finish(bound(120)) == 0, again.stderr
    assert f"resumed at step {kept}" in again.stdout, job.stdout + again.stdout
    assert "done at step 230" in again.stdout
    assert not again.survivors()
