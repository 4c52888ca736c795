"""The memory doctor end to end on CPU ranks (gloo, 3 ranks): an allocation the host refuses is
named with its figures on the rank that made it, rank 0 or another; a rank whose memory grows
every step is named with its rate, and its peak as standing out. GPU figures (a real CUDA
OOM): tests/gpu/test_memory_gpu.py."""

from __future__ import annotations

import re

import pytest

from tests.e2e import reference
from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(240)
SCRIPT = str(SCRIPTS / "memory_faults.py")


@pytest.mark.parametrize("rank", [0])  # rank 0: its store goes with it (any rank: test_blame)
def test_a_rank_the_allocator_refuses_is_named_with_what_it_asked_and_held(tmp_path, rank):
    job = start(["-n", "3", "--grace", "2", SCRIPT, "oom", str(rank)], tmp_path)
    assert job.finish(bound(120)) == 1, job.stderr
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    assert cause.startswith(
        f"rank {rank} ran out of host memory at memory_faults.py:34 in <module>: asked for "
        "1 TiB; the host ("
    ), cause
    assert "fix: one allocation of 1 TiB is more than the machine's memory (" in job.stderr
    assert "check the size computed at memory_faults.py:34" in job.stderr
    assert "Warning" not in job.stderr, "ddpkit's own scan prints no warnings"
    assert "parameters " in cause
    assert "optimizer state " in cause
    assert not job.survivors()


def test_memory_that_grows_every_step_is_said_then_named_as_the_cause_of_the_oom(tmp_path):
    # rank 1 keeps 2 MiB a step; 20 s in, its address space is capped (as `ulimit -v` caps a
    # job), and the leak runs it out of memory: the notice comes first, then the verdict names
    # the growth and the limit, not the last 2 MiB
    job = start(["-n", "3", "--grace", "2", SCRIPT, "leak"], tmp_path)
    assert job.finish(bound(150)) == 1, job.stderr
    leak = next(line for line in job.err if "resident memory grows" in line)
    rate = float(re.search(r"grows ([\d.]+) MiB a step", leak).group(1))
    assert 1.5 < rate < 2.6, leak  # 2 MiB a step, give or take the allocator
    assert not [line for line in job.err if re.search(r"memory: rank [02]", line)], job.stderr
    assert any("memory: rank 1's peak" in line for line in job.err), job.stderr
    cause = re.search(r"root cause: (.*)", job.stderr).group(1)
    # where the allocator failed is wherever the next allocation came (the leak's own line,
    # or inside backward under load): the cause is the growth either way
    assert re.match(
        r"rank 1 ran out of host memory at memory_faults\.py:\d+ in <module> after its memory "
        r"grew step after step \(",
        cause,
    ), cause
    assert "the host's address-space limit (RLIMIT_AS: ulimit -v)" in cause
    assert "fix: find what keeps memory every step" in job.stderr
    assert "micro-batches" not in job.stderr
    assert "Warning" not in job.stderr, "ddpkit's own scan prints no warnings"
    assert not job.survivors()


FIT = str(SCRIPTS / "fits_the_batch.py")
LOSS = re.compile(r"loss rank (\d) step (\d+) = (\S+)")


def losses(text: str) -> dict[tuple[int, int], str]:
    return {(int(r), int(s)): v for r, s, v in LOSS.findall(text)}


def test_a_batch_that_does_not_fit_on_one_rank_is_halved_on_every_rank_and_resumes(tmp_path):
    # rank 1 runs out of memory at micro-batch 32: every rank halves, at the same step, and
    # the losses are those of a run that started at 16 (tests/e2e/reference.py); a resumed
    # run goes on at 16
    fitted = start(["-n", "3", FIT, str(tmp_path / "a"), "--steps", "6", "--stop-after", "4"],
                   tmp_path)  # fmt: skip
    small = reference.never_stopped(FIT, [str(tmp_path / "b"), "--steps", "6", "--micro", "16"],
                                    3, tmp_path / "reference")  # fmt: skip
    assert fitted.finish(bound(120)) == 0, fitted.stderr
    said = [line for line in fitted.err if "ran out of memory at micro-batch" in line]
    assert said == ["[rank 0] ddpkit: rank 1 ran out of memory at micro-batch 32: every rank "
                    "now runs 2 x 16\n"], fitted.stderr  # fmt: skip
    expected = losses(small)
    assert sorted(expected) == [(r, s) for r in range(3) for s in range(1, 7)]
    got = losses(fitted.stdout)
    assert sorted(got) == [(r, s) for r in range(3) for s in range(1, 5)]
    assert {k: expected[k] for k in got} == got
    resumed = start(["-n", "3", FIT, str(tmp_path / "a"), "--steps", "6"], tmp_path)
    assert resumed.finish(bound(120)) == 0, resumed.stderr
    assert "ran out of memory" not in resumed.stderr, "the micro-batch was kept in the state"
    rest = losses(resumed.stdout)
    assert sorted(rest) == [(r, s) for r in range(3) for s in (5, 6)]
    assert {k: expected[k] for k in rest} == rest
    for job in (fitted, resumed):
        assert not job.survivors()
