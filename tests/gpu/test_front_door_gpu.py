"""The front door on a GPU: a device-side assert is named as what it usually is, with the line
it surfaced at said to be that and how to get the real one; a leak that fills the GPU within a
dozen steps is named as the growth it is, not given fixes that shrink the step.

Run with `python -m pytest -m gpu tests/gpu/test_front_door_gpu.py` (benchmarks/gpu.sh tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCRIPT = str(Path(__file__).parent / "scripts" / "front_door_gpu.py")


def test_a_device_side_assert_says_where_it_surfaced_what_it_usually_is_and_the_real_line(
    tmp_path,
):
    job = start(["-n", "1", SCRIPT, "assert"], tmp_path)
    assert job.finish(240) != 0, job.stderr
    print(job.stderr[-3000:])
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    assert "device-side assert" in cause, job.stderr
    fix = re.search(r"fix: (.*)", job.stderr).group(1)
    assert "the line named is where the error surfaced" in fix
    assert "nn.Embedding's num_embeddings" in fix
    assert "CUDA_LAUNCH_BLOCKING=1" in fix
    assert not job.survivors()


def test_a_leak_that_fills_the_gpu_within_a_dozen_steps_is_named_as_growth(tmp_path):
    job = start(["-n", "1", SCRIPT, "leak"], tmp_path)
    assert job.finish(240) != 0, job.stderr
    print(job.stderr[-3000:])
    steps = len(re.findall(r"\] step \d+ loss", job.stdout))
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    assert "ran out of GPU memory" in cause, job.stderr
    assert steps <= 12, f"a leak that fills the GPU within a dozen steps, not {steps}"
    assert "after its memory grew step after step" in cause, f"{steps} steps:\n{job.stderr}"
    fix = re.search(r"fix: (.*)", job.stderr).group(1)
    assert fix.startswith("find what keeps memory every step"), fix
    assert "autocast" not in fix
    assert not job.survivors()
