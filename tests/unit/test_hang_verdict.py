"""The hang doctor's reading of stacks and records, and its verdict line (pure logic)."""

from __future__ import annotations

import threading

from ddpkit import frames, protocol
from ddpkit.launch.hang import Frame, main_thread, parse_threads, user_frames, verdict, where

# Library frames are where torch, ddpkit and Python really are on this machine.
C10D = frames._torch_dir() + "distributed/distributed_c10d.py"
DUMP = f"""Thread 0x00007f01 (most recent call first):
  File "{threading.__file__}", line 320 in wait
  File "{threading.__file__}", line 622 in wait

Current thread 0x00007f00 (most recent call first):
  File "{C10D}", line 2501 in all_reduce
  File "/home/me/train.py", line 42 in step
  File "/home/me/train.py", line 60 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "{frames.BOOTSTRAP}", line 150 in main
  File "{frames.BOOTSTRAP}", line 210 in <module>
"""


def test_faulthandler_dumps_are_split_into_threads_and_frames():
    threads = parse_threads(DUMP)
    assert len(threads) == 2
    main = main_thread(threads)
    assert main[0] == Frame(C10D, 2501, "all_reduce")
    assert [str(f) for f in user_frames(main)] == ["train.py:42 in step", "train.py:60 in <module>"]


def test_a_rank_inside_a_collective_is_placed_there_from_its_stack():
    assert where(main_thread(parse_threads(DUMP)), None, None) == (
        "wait in all_reduce",
        "train.py:42",
    )


def test_the_record_names_the_call_site_of_a_collective_in_flight():
    record = protocol.Record(3, 0, 1.0, True, "broadcast", "[4]", "model.py:7")
    assert where([], record, None) == ("wait in broadcast", "model.py:7")


def test_a_pending_nccl_collective_places_the_rank_in_it():
    record = protocol.Record(5, 0, 0.0, False, "all_reduce", "[8]", "train.py:13")
    assert where(
        [Frame("/home/me/train.py", 14, "<module>")], record, None, "all_reduce #6 (scheduled)"
    ) == ("wait in all_reduce", "train.py:13")


def test_an_exited_rank_says_so():
    assert where([], None, 0) == ("has exited (code 0)", "")


def test_the_verdict_groups_ranks_largest_group_first():
    places = {
        0: ("wait in all_reduce", "train.py:42"),
        1: ("is elsewhere: stuck_here", "train.py:17"),
        2: ("wait in all_reduce", "train.py:42"),
    }
    assert verdict(places) == (
        "ranks 0,2 wait in all_reduce (train.py:42); rank 1 is elsewhere: stuck_here (train.py:17)"
    )


def test_flight_recorder_progress_reads_completed_and_pending_sequence_numbers():
    from ddpkit.launch.flight import pending, progress_state

    dump = {
        "entries": [
            {"collective_seq_id": 1, "state": "completed", "profiling_name": "nccl:all_reduce"},
            {"collective_seq_id": 2, "state": "completed", "profiling_name": "nccl:all_reduce"},
            {"collective_seq_id": 3, "state": "started", "profiling_name": "nccl:broadcast"},
        ]
    }
    assert progress_state(dump) == (2, 3)
    assert pending(dump) == "broadcast #3 (started)"
    assert progress_state({"entries": []}) == (-1, None)


def test_user_code_in_folders_named_like_libraries_is_the_users():
    for folder in ("/home/me/ddpkit", "/home/me/torch", "/home/me/runpy", "/srv/ddpkit/launch"):
        assert not frames.is_library(f"{folder}/train.py"), folder
    assert frames.is_library(C10D)
    assert frames.is_library(threading.__file__)
    assert frames.is_library(frames.BOOTSTRAP)
    assert not frames.is_library(frames.EXAMPLES_DIR + "digits.py"), "examples are user code"


def test_a_collective_in_a_users_folder_named_distributed_is_not_torchs():
    mine = [Frame("/home/me/distributed/ops.py", 5, "all_reduce")]
    assert where(mine, None, None) == ("is elsewhere: all_reduce", "ops.py:5")


def test_a_rank_blocked_in_backward_waits_in_ddps_all_reduce_at_the_backward_call():
    tensor_py = frames._torch_dir() + "_tensor.py"
    stack = [
        Frame(tensor_py, 625, "backward"),
        Frame("/home/me/train.py", 50, "_run_batch"),
        Frame("/home/me/train.py", 80, "<module>"),
    ]
    assert where(stack, None, None) == ("wait in all_reduce", "train.py:50")
