"""The flight-recorder status the hang watch polls, from a real process group. gloo's
collectives are recorded where torch has `_dump_fr_trace` (2.13 and 2.14 here); torch 2.4 records
NCCL's only, so there these tests skip and gloo verdicts come from the ranks' stacks alone."""

from __future__ import annotations

import pickle
import time

import pytest

from ddpkit.launch.base.wait import Wait
from ddpkit.launch.hang import flight_dumps
from tests.groups.harness import run_ranks

torch = pytest.importorskip("torch")
GLOO_RECORDED = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
needs_gloo_recorder = pytest.mark.skipif(
    not GLOO_RECORDED,
    reason=f"torch {torch.__version__}'s flight recorder keeps NCCL's collectives only, not gloo's",
)
RING = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}


def _dumps(rank, world, tmp):
    import torch.distributed as dist

    import ddpkit
    from ddpkit.launch.hang import flight_dumps
    from ddpkit.rank.flight_answers import dump

    with ddpkit.setup() as s:
        for _ in range(7):
            dist.all_reduce(torch.ones(4))
        s.barrier()
        # the recorder marks a collective completed from another thread, after the caller's
        # wait returned: CI under load read 6 of the 7 completed and none pending, and once
        # the barrier still pending after 5 s of polls; it catches up
        began, polls = time.monotonic(), 0
        while True:
            status = pickle.loads(dump(full=False, backend="gloo"))
            completed, waiting = flight_dumps.progress_state(status)
            polls += 1
            if (waiting is None and completed >= 7) or time.monotonic() - began > 30:
                break
            time.sleep(0.1)
        full = pickle.loads(dump(backend="gloo"))
        polled = f"{polls} polls in {time.monotonic() - began:.1f} s"
        return status, full, flight_dumps.progress_state(status), polled


@needs_gloo_recorder
def test_the_recorder_read_is_the_one_holding_this_groups_collectives(tmp_path):
    for _, full, _, _ in run_ranks(_dumps, 2, tmp_path, env=RING):
        assert len(full["entries"]) >= 7, f"torch {torch.__version__}: {sorted(full)}"
        ops = {str(e.get("profiling_name")) for e in full["entries"]}
        assert any("all_reduce" in op or "allreduce" in op for op in ops), ops


@pytest.mark.skipif(GLOO_RECORDED, reason=f"torch {torch.__version__} records gloo's collectives")
def test_without_a_gloo_recorder_the_dump_reads_as_no_progress_and_nothing_pending(tmp_path):
    # torch 2.4: the watch must neither count this as progress nor place a rank in a collective
    for _, full, state, _ in run_ranks(_dumps, 2, tmp_path, env=RING):
        assert full.get("entries", []) == []
        assert state == (-1, None)
        assert flight_dumps.pending(full) is None


@needs_gloo_recorder
def test_the_status_poll_carries_progress_without_the_collectives(tmp_path):
    results = run_ranks(_dumps, 2, tmp_path, env=RING)
    if "pg_status" not in results[0][0]:
        pytest.skip(f"torch {torch.__version__}'s recorder has no process-group status")
    for status, full, (completed, waiting), polled in results:
        assert "entries" not in status
        assert len(full["entries"]) >= 7
        assert completed >= 7
        assert waiting is None, f"{polled}: {status['pg_status']}"


def test_a_collective_enqueued_but_not_completed_is_pending():
    from ddpkit.launch.hang.flight_dumps import progress_state

    status = {
        "pg_status": {
            "0": {"last_enqueued_collective": 12, "last_completed_collective": 11},
            "1": {"last_enqueued_collective": 3, "last_completed_collective": 3},
        }
    }
    assert progress_state(status) == (14, (("0", 12),))


def _served(rank, world, tmp):
    from pathlib import Path

    import torch.distributed as dist

    import ddpkit
    from ddpkit.launch.hang import flight_dumps
    from ddpkit.rank import flight_answers as rank_flight

    with ddpkit.setup() as s:
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        state = Path(tmp)
        rank_flight.serve(str(state), str(rank), "gloo")  # as the bootstrap does after init
        flight_dumps.ask(state, rank)
        answer = None
        for _ in range(100):
            answer = flight_dumps.answer(state, rank)
            if answer is not None:
                break
            time.sleep(0.1)
        full = flight_dumps.request([rank], state, Wait()).get(rank)
        s.barrier()
        return answer, full


def test_the_watch_asks_for_status_and_the_report_for_the_collectives(tmp_path):
    results = run_ranks(_served, 2, tmp_path, env=RING)
    for answer, full in results:
        assert answer is not None, "the rank's thread did not answer within 10 s"
        if "pg_status" not in answer:
            pytest.skip("this torch's recorder has no process-group status")
        assert "entries" not in answer
        assert len(full["entries"]) >= 3


def _report_during_a_poll(rank, world, tmp):
    from pathlib import Path

    import torch.distributed as dist

    import ddpkit
    from ddpkit.launch.hang import flight_dumps
    from ddpkit.rank import flight_answers as rank_flight

    with ddpkit.setup() as s:
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        state = Path(tmp)
        rank_flight.serve(str(state), str(rank), "gloo")
        flight_dumps.ask(state, rank)  # the watch's poll, not answered yet
        full = flight_dumps.request([rank], state, Wait()).get(rank)  # the report, at once
        s.barrier()
        return full


@needs_gloo_recorder
def test_a_report_asked_while_a_status_poll_is_unanswered_gets_the_collectives(tmp_path):
    # the watch polls, then declares the hang and asks for the report in the same second
    for full in run_ranks(_report_during_a_poll, 2, tmp_path, env=RING):
        assert full is not None, "the rank did not answer the report's request"
        assert len(full.get("entries", [])) >= 3, sorted(full)
