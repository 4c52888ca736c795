"""What a restart cost, in one line (ddpkit.launch.recovery): the step the failed rank was in,
the step the restarted ranks began with, the time between, from the ranks' count records
(written here in protocol's format, as ddpkit.train.step_count writes them), as the
supervisor's snapshot reads them."""

from __future__ import annotations

from ddpkit.common import protocol
from ddpkit.launch import recovery
from ddpkit.launch.report import Outcome
from tests.unit.snapshots import look, worker

OUTCOME = Outcome(
    ok=False,
    exit_code=1,
    root_rank=1,
    summary="rank 1 exited with code 1 (RuntimeError: boom) at train.py:9 in step",
)


def count(state, rank, base, done, first_end=0.0, loaded=True, rescued=False):
    path = protocol.state_path(state, rank, protocol.COUNT)
    path.write_bytes(protocol.COUNT_FORMAT.pack(base, done, first_end, loaded, rescued))


def running(state, *ranks):
    return look(state, [worker(rank) for rank in ranks])


def failed(tmp_path):
    old = tmp_path / "state0"
    old.mkdir()
    count(old, 0, base=0, done=14)
    count(old, 1, base=0, done=14)
    ended = look(old, [worker(0, 1, ended=105.0), worker(1, 1, ended=100.0)])
    return recovery.failure_of(OUTCOME, ended, "attempt 2 of 2")


def test_the_failure_is_the_root_ranks_step_and_time(tmp_path):
    failure = failed(tmp_path)
    assert (failure.who, failure.step, failure.wall) == ("rank 1", 15, 100.0)
    assert failure.cause == "exited with code 1 (RuntimeError: boom)"


def test_nothing_is_said_before_a_restarted_rank_ends_a_step(tmp_path):
    failure, new = failed(tmp_path), tmp_path / "state1"
    new.mkdir()
    count(new, 0, base=14, done=0, rescued=True)
    assert recovery.went_on(failure, running(new, 0, 1)) is None


def test_a_rescued_restart_says_no_step_was_lost_and_its_time(tmp_path):
    failure, new = failed(tmp_path), tmp_path / "state1"
    new.mkdir()
    count(new, 1, base=14, done=1, first_end=102.5, rescued=True)
    assert recovery.went_on(failure, running(new, 0, 1)) == (
        "rank 1 failed after step 14 (exited with code 1 (RuntimeError: boom)); resumed after "
        "step 14 in 2.5 s, 0 steps lost (the state the ranks left wrote at the failure); "
        "attempt 2 of 2"
    )


def test_a_restart_from_the_last_save_counts_the_steps_done_again(tmp_path):
    failure, new = failed(tmp_path), tmp_path / "state1"
    new.mkdir()
    count(new, 0, base=10, done=3, first_end=104.0)
    line = recovery.went_on(failure, running(new, 0))
    assert "resumed after step 10 in 4.0 s, 4 steps lost (the last saved state)" in line


def test_a_script_that_loads_no_state_is_told_it_started_over_and_how_to_keep_its_steps(tmp_path):
    failure, new = failed(tmp_path), tmp_path / "state1"
    new.mkdir()
    count(new, 0, base=0, done=1, first_end=103.0, loaded=False)
    line = recovery.went_on(failure, running(new, 0))
    assert "restarted from step 0, its first step 3.0 s after the failure" in line
    assert "the script loads no state, so its 14 steps are trained again" in line
    assert "s.save_state every few steps and s.load_state at the start" in line
