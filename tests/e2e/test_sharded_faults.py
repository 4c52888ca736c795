"""A stall and a crash inside a sharded (FSDP2) step, under `ddpkit run` on 2 gloo ranks: the
hang verdict places the stalled rank at its line and the other in FSDP's collective; a crash
ends every rank and names the one that failed; nothing is left running."""

from __future__ import annotations

import pytest
import torch

from ddpkit.train.sharding import NEEDS_ON_GLOO, torch_version
from tests.e2e.helpers import SCRIPTS, start

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        torch_version() < NEEDS_ON_GLOO,
        reason=f"sharding on gloo needs torch {NEEDS_ON_GLOO}; this is {torch.__version__}",
    ),
]
SCRIPT = str(SCRIPTS / "sharded_train.py")


def test_a_stall_inside_a_sharded_step_is_named_at_the_users_line(tmp_path):
    job = start(["-n", "2", "--hang-timeout", "5", "--grace", "1", SCRIPT, "--stall-at", "3"],
                tmp_path)  # fmt: skip
    assert job.finish(120) == 124, job.stderr[-3000:]
    line = next(x for x in job.stderr.splitlines() if "root cause:" in x)
    assert "rank 1 is elsewhere: forward (sharded_train.py:30)" in line, line
    assert "rank 0 waits in FSDP's" in line, line
    assert not job.survivors()


def test_a_crash_inside_a_sharded_step_names_the_rank_and_ends_every_rank(tmp_path):
    job = start(["-n", "2", "--grace", "1", SCRIPT, "--crash-at", "3"], tmp_path)
    assert job.finish(120) == 1, job.stderr[-3000:]
    assert (
        "root cause: rank 1 exited with code 1 (RuntimeError: planted failure in a sharded "
        "step 3)" in job.stderr
    )
    assert not job.survivors()
