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


TRAINER = str(SCRIPTS / "snapshot_trainer.py")
STEP = re.compile(r"step (\d+) loss (\S+)")
SAMPLES = re.compile(r"rank \d attempt \d epoch (\d) step \d+ samples ([\d,]+)")


def test_a_job_stopped_on_2_cpu_ranks_goes_on_on_the_gpu(tmp_path):
    """World size 2 (gloo, CPU) to 1 (NCCL, GPU 0): the loader's place follows, the global
    batch of 6 is kept, the random streams (CUDA's too) are re-seeded, every sample once."""
    args = [TRAINER, "2", "1", "--batch_size", "3", "--snapshot_path", str(tmp_path / "s")]
    never = start(["-n", "cpu", *args[:-1], str(tmp_path / "never")], tmp_path)
    assert never.finish(200) == 0, never.stderr
    expected = {int(s): float(v) for s, v in STEP.findall(never.stdout)}
    first = start(["-n", "cpu", *args, "--sleep", "0.2"], tmp_path)
    first.wait_for("step 5 loss", timeout=200)
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(200) == 143, first.stderr
    second = start(["-n", "gpu", *args], tmp_path)
    assert second.finish(300) == 0, second.stderr
    said = second.stdout + second.stderr
    assert "was saved by 2 ranks; this job has 1" in said
    assert "global batch 6 kept: 6 per rank (was 3)" in said
    assert "nccl" in said
    seen: dict[int, list[int]] = {}
    for epoch, ids in SAMPLES.findall(first.stdout + second.stdout):
        seen.setdefault(int(epoch), []).extend(int(i) for i in ids.split(","))
    assert all(sorted(s) == list(range(240)) for s in seen.values()), "every sample once"
    got = {int(s): float(v) for s, v in STEP.findall(first.stdout + second.stdout)}
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), f"step {step}"
    print(f"2 CPU ranks -> 1 GPU: {len(got)} steps within 1e-4 of the never-stopped run")
