"""The memory doctor end to end on CPU ranks (gloo, 3 ranks): an allocation the host refuses is
named with its figures on the rank that made it, rank 0 or another; a rank whose memory grows
every step is named with its rate, and its peak as standing out. GPU figures (a real CUDA
OOM): tests/gpu/test_memory_gpu.py."""

from __future__ import annotations

import re

import pytest

from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(240)
SCRIPT = str(SCRIPTS / "memory_faults.py")


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_the_allocator_refuses_is_named_with_what_it_asked_and_held(tmp_path, rank):
    job = start(["-n", "3", "--grace", "2", SCRIPT, "oom", str(rank)], tmp_path)
    assert job.finish(bound(120)) == 1, job.stderr
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    assert cause.startswith(
        f"rank {rank} ran out of host memory at memory_faults.py:30 in <module>: asked for "
        "1024.00 GiB; the host ("
    ), cause
    assert "parameters " in cause
    assert "optimizer state " in cause
    assert not job.survivors()


def test_a_rank_whose_memory_grows_every_step_is_named_with_its_rate(tmp_path):
    job = start(["-n", "3", "--grace", "2", SCRIPT, "leak"], tmp_path)
    try:
        job.wait_for("[rank 1] leaking", timeout=bound(60))
        job.wait_for("memory: rank 1's resident memory grows", timeout=bound(60))
        job.wait_for("memory: rank 1's peak", timeout=bound(60))
    finally:
        job.proc.terminate()
        job.finish(60)
    leak = next(line for line in job.err if "resident memory grows" in line)
    rate = float(re.search(r"grows ([\d.]+) MiB a step", leak).group(1))
    assert 1.5 < rate < 2.6, leak  # 2 MiB a step, give or take the allocator
    assert not [line for line in job.err if re.search(r"memory: rank [02]", line)], job.stderr
    assert not job.survivors()
