"""Exact resume with NCCL on every visible GPU, deterministic kernels: the run stopped by
SIGTERM and started again prints every step's loss as the run that never stopped."""

from __future__ import annotations

import re
import signal

import pytest

from tests.e2e.helpers import SCRIPTS, start
from tests.e2e.test_resume_sizes import losses

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SCRIPT = str(SCRIPTS / "resumable.py")


def test_a_sigterm_stopped_nccl_run_resumes_exactly(tmp_path):
    n = str(GPUS)
    whole = start(["-n", n, SCRIPT, str(tmp_path / "a"), "--deterministic"], tmp_path)
    assert whole.finish(300) == 0, whole.stderr
    expected = losses(whole.stdout)
    first = start(
        ["-n", n, SCRIPT, str(tmp_path / "b"), "--deterministic", "--sleep", "0.1"], tmp_path
    )
    first.wait_for("epoch 1 step", timeout=200)
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(200) == 143
    assert re.search(r"stopped at step \d+, state saved", first.stdout), first.stdout
    second = start(["-n", n, SCRIPT, str(tmp_path / "b"), "--deterministic"], tmp_path)
    assert second.finish(300) == 0, second.stderr
    got = {**losses(first.stdout), **losses(second.stdout)}
    assert got == expected
    print(f"resume on {n} GPU(s): {len(expected)} (rank, step) losses equal")
