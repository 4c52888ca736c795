"""A script's own init arguments under `ddpkit run` (issue 35), with PyTorch's DDP tutorial's
set-up moved to a launcher as users move it: a world size or a rank the job does not have
fails at once with the argument, its line, the launcher's value and the fix (never a silent
wait for the hang timeout); the tutorial's own MASTER_PORT is replaced by the job's, said
once, so two jobs at once do not clash; an init that never completes is bounded by
--init-timeout however the script calls it. Nothing is left running."""

from __future__ import annotations

import os
import re
import socket
import time

import pytest

from tests.e2e.helpers import SCRIPTS, bound, start

pytestmark = pytest.mark.timeout(200)
SCRIPT = str(SCRIPTS / "tutorial_setup.py")


def root_cause(job) -> str:
    found = re.search(r"root cause: (.*)", job.stderr)
    assert found, job.stderr
    return found.group(1)


def test_a_world_size_written_in_the_script_fails_at_once_with_the_fix(tmp_path):
    began = time.monotonic()
    job = start(["-n", "2", "--init-timeout", "20", SCRIPT, "world", "4"], tmp_path)
    assert job.finish(bound(60)) == 1, job.stderr
    assert time.monotonic() - began < bound(19), "not a wait for --init-timeout"
    # whichever rank reaches init first names it (the other may still be importing torch on a
    # loaded machine, and is then stopped before it gets there)
    cause = root_cause(job)
    assert re.match(
        r"rank ([01]) exited with code 1 \(InitMismatchError: init_process_group\(world_size=4\) "
        r"at tutorial_setup\.py:28, but ddpkit run started 2 rank\(s\); this is rank \1: the "
        r"job would wait at init for ranks that do not exist\) at tutorial_setup\.py:28 in "
        r"ddp_setup",
        cause,
    ), job.stderr
    assert "fix: leave world_size out of init_process_group" in job.stderr
    assert "to run 4 ranks: ddpkit run -n 4" in job.stderr
    assert re.search(
        r"other ranks: [01] (failed the same way \(InitMismatchError\)|stopped by ddpkit)",
        job.stderr,
    ), job.stderr
    assert "] error:" not in job.stderr, "said once, in the report"
    assert not job.survivors()


def test_the_same_rank_passed_on_every_rank_is_named_on_the_rank_it_is_wrong_for(tmp_path):
    job = start(["-n", "3", "--init-timeout", "30", SCRIPT, "rank0"], tmp_path)
    assert job.finish(bound(60)) == 1, job.stderr
    cause = root_cause(job)
    assert re.match(
        r"rank [12] exited with code 1 \(InitMismatchError: init_process_group\(rank=0\) at "
        r"tutorial_setup\.py:28, but ddpkit run started 3 rank\(s\); this is rank [12]",
        cause,
    ), cause
    assert "LOCAL_RANK is the rank on this node" in job.stderr
    assert not job.survivors()


def test_the_tutorials_own_port_is_replaced_so_two_jobs_at_once_both_train(tmp_path):
    # MASTER_PORT exported in the shell too: ddpkit run says it does not use it
    env = {"MASTER_PORT": "29500"}
    jobs = [start(["-n", "2", SCRIPT, "port"], tmp_path, env=env) for _ in range(2)]
    for job in jobs:
        assert job.finish(bound(120)) == 0, job.stderr
        assert "[GPU1] trained 20 steps" in job.stdout
        said = [line for line in job.err if "the script sets" in line]
        assert len(said) == 1, job.stderr
        assert said[0].startswith(
            "[rank 0] ddpkit: the script sets MASTER_ADDR=localhost (tutorial_setup.py:22), "
            "MASTER_PORT=12355 (tutorial_setup.py:23); ddpkit run's ranks meet at 127.0.0.1:"
        )
        assert "ddpkit: warning: MASTER_PORT=29500 is set in this shell" in job.stderr
        assert not job.survivors()


def test_an_init_that_never_completes_is_bounded_by_the_init_timeout(tmp_path):
    began = time.monotonic()
    job = start(["-n", "2", "--init-timeout", "6", SCRIPT, "file"], tmp_path)
    assert job.finish(bound(60)) == 1, job.stderr
    assert time.monotonic() - began < bound(40)
    # the wait is said as measured: at least the timeout, a poll or two more under load
    waited = re.match(
        r"init_process_group did not complete: ranks 0,1 waited (\d+) s in it "
        r"\(--init-timeout 6\)",
        root_cause(job),
    )
    assert waited, job.stderr
    assert 6 <= int(waited[1]) <= 12, job.stderr
    assert "rank 0 waits in init_process_group at tutorial_setup.py:26" in job.stderr
    assert "a script's own store or init_method='file://...' must be the same" in job.stderr
    assert not job.survivors()


def test_a_port_the_script_takes_that_is_in_use_names_its_holder_and_the_fix(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        job = start(["-n", "2", "--grace", "1", str(SCRIPTS / "own_store.py"), str(port)], tmp_path)
        assert job.finish(bound(60)) == 1, job.stderr
    finally:
        holder.close()
    assert "EADDRINUSE" in root_cause(job)
    assert f"fix: port {port} is held by pid {os.getpid()} (" in job.stderr
    assert "let ddpkit run choose the port" in job.stderr
    assert not job.survivors()
