"""The rank at fault is named wherever it is, rank 0 included: the same decisions that the
fault runs of tests/e2e/test_fault_verdicts.py make end to end (there, once each, mostly on a
rank other than 0), here over real state files with the culprit at every rank of 3."""

from __future__ import annotations

import signal
import time

import pytest

from ddpkit.common import protocol
from ddpkit.launch import report
from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.hang import places
from tests.unit.snapshots import failed_outcome, look, waited_for, worker

RANKS = (0, 1, 2)


def others(culprit: int) -> list[int]:
    return [r for r in RANKS if r != culprit]


def lost(state, rank: int, message: str, at: float) -> None:
    protocol.write_error(state, rank, protocol.ErrorRecord(at, "RuntimeError", message))


@pytest.mark.parametrize("culprit", RANKS)
def test_the_rank_that_ran_out_of_batches_is_named_not_the_ranks_that_waited(tmp_path, culprit):
    now = time.time()
    protocol.write_ended(tmp_path, culprit, 0)
    for r in others(culprit):
        lost(tmp_path, r, "Connection closed by peer [127.0.0.1]:1234", now + 0.2)
    workers = [worker(culprit, 0, now)] + [worker(r, 1, now + 0.3) for r in others(culprit)]
    found = waited_for(look(tmp_path, workers), lambda alive: {})
    assert found is not None
    assert found.rank == culprit
    assert list(found.victims) == others(culprit)
    a, b = others(culprit)
    assert found.summary.startswith(f"rank {culprit} ended (exit code 0) while ranks {a},{b}")


@pytest.mark.parametrize("culprit", RANKS)
def test_the_rank_the_others_timed_out_for_is_named_where_it_was(tmp_path, culprit):
    now = time.time()
    for r in others(culprit):
        lost(tmp_path, r, "Timed out waiting 6000ms for recv operation to complete", now)
    workers = [worker(culprit)] + [worker(r, 1, now) for r in others(culprit)]
    asked = []

    def places_of(alive):
        asked.append(alive)
        return dict.fromkeys(alive, Place(Doing.ELSEWHERE, "train.py:21", func="evaluate"))

    found = waited_for(look(tmp_path, workers), places_of)
    assert asked == [[culprit]], "only the live rank's place is asked for"
    assert found is not None
    assert found.rank == culprit
    a, b = others(culprit)
    assert found.summary.startswith(
        f"rank {culprit} kept the others waiting: it was at evaluate (train.py:21) when "
        f"ranks {a},{b} timed out waiting for it"
    )


@pytest.mark.parametrize("culprit", RANKS)
def test_a_victim_slower_to_exit_is_not_named_in_the_culprits_place(tmp_path, culprit):
    # on a loaded machine one victim has exited and the other is still on its way out: it has
    # recorded its error, or not yet and gives no stack; the evaluating rank is named all the same
    now = time.time()
    first, slow = others(culprit)
    lost(tmp_path, first, "Timed out waiting 6000ms for recv operation to complete", now)
    workers = [worker(culprit), worker(first, 1, now), worker(slow)]
    where = {
        culprit: Place(Doing.ELSEWHERE, "train.py:21", func="evaluate"),
        slow: Place(Doing.NO_STACK),
    }
    found = waited_for(look(tmp_path, workers), lambda alive: {r: where[r] for r in alive})
    assert found is not None
    assert found.rank == culprit
    lost(tmp_path, slow, "Timed out waiting 6000ms for recv operation to complete", now + 0.1)
    asked = []
    found = waited_for(look(tmp_path, workers), lambda alive: asked.append(alive) or where)
    assert asked == [[culprit]], "a rank that recorded its error is a victim, not a suspect"
    assert found is not None
    assert found.rank == culprit


@pytest.mark.parametrize("culprit", RANKS)
@pytest.mark.parametrize(
    ("state", "words"),
    [
        (Place(Doing.HOLDS_GIL, seconds=6, func="match"), "holds the GIL in C code for 6 s: match"),
        (
            Place(Doing.STOPPED, pid=4242),
            "is stopped (SIGSTOP, SIGTSTP or Ctrl+Z; `kill -CONT 4242` resumes it)",
        ),
    ],
)
def test_a_hang_verdict_puts_the_rank_that_cannot_run_apart_from_the_waiting(culprit, state, words):
    where = dict.fromkeys(others(culprit), Place(Doing.WAITS_IN, "train.py:30", op="all_reduce"))
    where[culprit] = state.at("train.py:16")
    said = places.verdict(where)
    a, b = others(culprit)
    assert said == f"ranks {a},{b} wait in all_reduce (train.py:30); rank {culprit} {words} " + (
        "(train.py:16)"
    )


@pytest.mark.parametrize("culprit", RANKS)
def test_a_rank_that_died_of_a_signal_is_the_root_cause_at_its_crash_site(tmp_path, culprit):
    now = time.time()
    protocol.state_path(tmp_path, culprit, protocol.FAULT).write_text(
        "Fatal Python error: Segmentation fault\n\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/home/u/dies_hard.py", line 24 in read_null\n'
        '  File "/home/u/dies_hard.py", line 40 in <module>\n'
    )
    for r in others(culprit):  # the victims notice later, and say that they lost a peer
        lost(tmp_path, r, "Connection closed by peer [127.0.0.1]:1234", now + 1)
    failed = [worker(culprit, -signal.SIGSEGV, now)]
    failed += [worker(r, 1, now + 1) for r in others(culprit)]
    outcome = failed_outcome(look(tmp_path, failed))
    assert outcome.root_rank == culprit
    assert outcome.summary.startswith(
        f"rank {culprit} died of SIGSEGV at dies_hard.py:24 in read_null"
    ), outcome.summary


@pytest.mark.parametrize("culprit", RANKS)
def test_the_first_error_that_is_not_a_lost_peer_is_the_root_cause_at_any_rank(tmp_path, culprit):
    now = time.time()
    protocol.write_error(
        tmp_path,
        culprit,
        protocol.ErrorRecord(now, "RuntimeError", "DefaultCPUAllocator: not enough memory"),
    )
    for r in others(culprit):  # rank 0's end takes the store: the others lose it first
        lost(tmp_path, r, "Connection closed by peer [127.0.0.1]:1234", now - 0.5)
    failed = [worker(r, 1, now) for r in RANKS]
    outcome = failed_outcome(look(tmp_path, failed))
    assert outcome.root_rank == culprit
    assert outcome.summary.startswith(f"rank {culprit} exited with code 1"), outcome.summary


def test_a_restarts_report_says_the_attempt_and_no_exit_code(tmp_path):
    outcome = report.Outcome(ok=False, exit_code=1, summary="rank 1 raised ValueError")
    outcome = outcome.finalize([], look(tmp_path, []), tmp_path)
    assert outcome.text.splitlines()[1] == "ddpkit: the job failed"
    assert outcome.text.splitlines()[-1] == "  exit code: 1"
    again = outcome.render(attempt="attempt 1 of 3").splitlines()
    assert again[1] == "ddpkit: attempt 1 of 3: the job failed"
    assert again[2] == "  root cause: rank 1 raised ValueError"
    assert not any("exit code" in line for line in again)
