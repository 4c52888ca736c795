"""A GPU that never finishes is called hung (issue 35): a kernel that spins forever
(torch.cuda._sleep) then the loss's .item(), as a deadlocked custom kernel or a wedged GPU
does. The host spins a core inside CUDA's wait, so CPU time must not count as progress: within
--hang-timeout the verdict names the rank, its line and its GPU ("waits for GPU 0, busy for
T s with no step ended"), and the job is torn down. A long kernel that ends before the timeout
is no hang. At world size 1 (NCCL), with a collective queued behind the kernel, and at 2 ranks
sharing one GPU (gloo) where the other rank waits in an all_reduce.

Run with `python -m pytest -m gpu tests/gpu/test_gpu_hang.py` (benchmarks/gpu.sh tests)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCRIPT = str(Path(__file__).parent / "scripts" / "gpu_hang.py")
WAITS = r"waits for GPU \d+, busy for \d+ s with no step ended \(\d+% utilised\)"


def hung(tmp_path, *args: str, timeout: int = 20) -> tuple[str, float]:
    began = time.monotonic()
    job = start(["--hang-timeout", str(timeout), "--grace", "3", *args], tmp_path)
    code = job.finish(200)
    took = time.monotonic() - began
    print(f"\n{job.stderr[-2500:]}\ntook {took:.0f} s")
    assert code == 124, job.stderr
    assert not job.survivors()
    return re.search(r"root cause: (.*)", job.stderr).group(1), took


def test_a_kernel_that_never_ends_is_a_hang_named_with_its_gpu_and_line(tmp_path):
    cause, took = hung(tmp_path, "-n", "1", SCRIPT, "forever", "0")
    assert re.search(rf"rank 0 {WAITS} \(gpu_hang\.py:44\)", cause), cause
    assert took < 20 + 40, "said within the hang timeout (plus start-up and teardown)"


def test_a_collective_queued_behind_the_kernel_is_still_the_gpus_wait(tmp_path):
    # NCCL at world size 1: the all_reduce sits behind the kernel that never ends
    cause, _ = hung(tmp_path, "-n", "1", SCRIPT, "queued", "0")
    assert re.search(rf"rank 0 {WAITS}", cause), cause


def test_the_rank_whose_gpu_never_finishes_is_named_not_the_rank_waiting_for_it(tmp_path):
    # two gloo ranks (-n cpu) on one GPU: rank 1's kernel never ends; rank 0 waits in all_reduce
    cause, _ = hung(tmp_path, "-n", "cpu", SCRIPT, "forever", "1", "gloo")
    assert re.search(rf"rank 1 {WAITS} \(gpu_hang\.py:44\)", cause), cause
    assert re.search(r"rank 0 waits in all_reduce \(gpu_hang\.py:\d+\)", cause), cause


def test_with_no_flag_a_kernel_that_never_ends_is_named_within_30_s_of_the_last_step(tmp_path):
    # the defaults: a job of short steps is judged by --hang-min (20 s), the wait counted from
    # when the rank began to wait for its GPU
    job = start(["-n", "1", "--grace", "3", SCRIPT, "forever", "0"], tmp_path)
    job.wait_for("step 2 loss", timeout=120)
    stalled = time.monotonic()
    job.wait_for("root cause:", timeout=90)
    took = time.monotonic() - stalled
    assert job.finish(60) == 124, job.stderr
    print(f"\n{job.stderr[-1500:]}\nnamed {took:.1f} s after the last step")
    assert took < 30, f"named {took:.1f} s after the last step"
    assert re.search(rf"rank 0 {WAITS} \(gpu_hang\.py:44\)", job.stderr), job.stderr
    assert "a hang after 20 s (--hang-min): its steps took at most" in job.stderr
    assert not job.survivors()


def test_a_long_kernel_that_ends_before_the_timeout_is_no_hang(tmp_path):
    job = start(["-n", "1", "--hang-timeout", "20", SCRIPT, "seconds:12", "0"], tmp_path)
    assert job.finish(200) == 0, job.stderr
    assert "hung" not in job.stderr
    assert "step 7 loss" in job.stdout
    assert not job.survivors()
