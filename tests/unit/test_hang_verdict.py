"""The hang doctor's reading of stacks and records, and its verdict line (pure logic)."""

from __future__ import annotations

import threading

import pytest

from ddpkit.common import frames, protocol
from ddpkit.common.frames import Frame, main_thread, parse_threads, user_frames
from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.hang.places import verdict, where

# Library frames are where torch, ddpkit and Python really are on this machine.
C10D = frames._torch_dir() + "distributed/distributed_c10d.py"
SITE = frames._site_dirs()[0]  # where installed frameworks (transformers, lightning) live
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
    assert where(main_thread(parse_threads(DUMP)), None, None) == Place(
        Doing.WAITS_IN, "train.py:42", op="all_reduce"
    )


def test_without_a_stack_the_record_names_the_call_site_of_a_collective_in_flight():
    record = protocol.Record(3, 0, 1.0, True, "broadcast", "[4]", "model.py:7")
    assert where([], record, None) == Place(Doing.WAITS_IN, "model.py:7", op="broadcast")


def test_an_nccl_collective_pending_through_a_hang_places_the_host_at_its_sync_line():
    record = protocol.Record(5, 0, 0.0, False, "all_reduce", "[8]", "train.py:13")
    stack = [Frame("/home/me/train.py", 14, "<module>")]
    assert where(stack, record, None, "nccl:all_reduce #6 (scheduled)", hung=True) == Place(
        Doing.WAITS_IN, "train.py:14", op="all_reduce"
    )


def test_a_rank_busy_in_its_own_code_is_placed_there_whatever_it_launched_before():
    # issue 21: rank 1 asleep in a Trainer callback while DDP's bucket all_reduce it launched
    # is still "scheduled" in its (gloo) flight recorder, its last collective a library gather
    record = protocol.Record(9, 0, 0.0, False, "all_reduce", "[4]", "operations.py:355")
    stack = [
        Frame("/home/me/train_hf.py", 15, "on_step_end"),
        Frame(SITE + "transformers/trainer_callback.py", 548, "call_event"),
        Frame(SITE + "transformers/trainer.py", 2620, "_inner_training_loop"),
        Frame("/home/me/train_hf.py", 40, "main"),
    ]
    assert where(stack, record, None, "gloo:all_reduce #9 (scheduled)", hung=True) == Place(
        Doing.ELSEWHERE, "train_hf.py:15", func="on_step_end"
    )


def test_a_live_rank_in_backward_is_in_backward_not_in_its_last_collective():
    # issue 21: `ddpkit stacks` said "wait in all_reduce (slow.py:42)", the loop's last explicit
    # all_reduce, while the stack stood at line 39 in loss.backward()
    record = protocol.Record(40, 0, 0.0, False, "all_reduce", "[1]", "slow.py:42")
    stack = [Frame(frames._torch_dir() + "_tensor.py", 625, "backward")]
    stack.append(Frame("/home/me/slow.py", 39, "<module>"))
    assert where(stack, record, None, "gloo:allreduce #81 (scheduled)") == Place(
        Doing.IN_BACKWARD, "slow.py:39"
    )


def test_inside_a_framework_the_site_names_its_line_and_the_scripts_line_that_called_it():
    stack = [
        Frame(C10D, 3400, "all_gather_into_tensor"),
        Frame(SITE + "accelerate/utils/operations.py", 355, "_gpu_gather_one"),
        Frame(SITE + "transformers/trainer.py", 2620, "_inner_training_loop"),
        Frame("/home/me/train_hf.py", 40, "main"),
        Frame("/home/me/train_hf.py", 60, "<module>"),
    ]
    assert where(stack, None, None, hung=True) == Place(
        Doing.WAITS_IN,
        "operations.py:355 in _gpu_gather_one from train_hf.py:40",
        op="all_gather_into_tensor",
    )


def test_an_exited_rank_says_so():
    place = where([], None, 0)
    assert place == Place(Doing.EXITED, code=0)
    assert place.words() == "has exited (code 0)"


def test_the_verdict_groups_ranks_largest_group_first():
    places = {
        0: Place(Doing.WAITS_IN, "train.py:42", op="all_reduce"),
        1: Place(Doing.ELSEWHERE, "train.py:17", func="stuck_here"),
        2: Place(Doing.WAITS_IN, "train.py:42", op="all_reduce"),
    }
    assert verdict(places) == (
        "ranks 0,2 wait in all_reduce (train.py:42); rank 1 is elsewhere: stuck_here (train.py:17)"
    )


def test_flight_recorder_progress_reads_completed_and_pending_sequence_numbers():
    from ddpkit.launch.hang.flight_dumps import pending, progress_state

    dump = {
        "entries": [
            {"collective_seq_id": 1, "state": "completed", "profiling_name": "nccl:all_reduce"},
            {"collective_seq_id": 2, "state": "completed", "profiling_name": "nccl:all_reduce"},
            {"collective_seq_id": 3, "state": "started", "profiling_name": "nccl:broadcast"},
        ]
    }
    assert progress_state(dump) == (2, 3)
    assert pending(dump) == "nccl:broadcast #3 (started)"
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
    assert where(mine, None, None) == Place(Doing.ELSEWHERE, "ops.py:5", func="all_reduce")


def test_a_rank_blocked_in_backward_through_a_hang_waits_in_ddps_all_reduce():
    tensor_py = frames._torch_dir() + "_tensor.py"
    stack = [
        Frame(tensor_py, 625, "backward"),
        Frame("/home/me/train.py", 50, "_run_batch"),
        Frame("/home/me/train.py", 80, "<module>"),
    ]
    assert where(stack, None, None, hung=True) == Place(
        Doing.WAITS_IN, "train.py:50", op="all_reduce"
    )


@pytest.mark.parametrize(
    ("backend", "before", "seen", "waits"),
    [
        ("nccl", (6, (("0", 7),)), (6, (("0", 7),)), True),  # the same pending twice: waits
        ("nccl", (6, (("0", 7),)), (7, (("0", 8),)), False),  # one completed between: moves
        ("nccl", None, (6, (("0", 7),)), False),  # the first poll: nothing to compare yet
        ("nccl", (7, None), (7, None), False),  # nothing pending: between collectives
        ("gloo", (6, (("0", 7),)), (6, (("0", 7),)), False),  # gloo's count lags: CPU decides
        (None, (6, (("0", 7),)), (6, (("0", 7),)), False),  # backend not known yet
    ],
)
def test_the_flight_recorder_says_a_rank_waits_only_for_nccl(backend, before, seen, waits):
    from ddpkit.launch.hang.progress_watch import waits_in_flight

    assert waits_in_flight(backend, before, seen) is waits


# -- ranks in different collectives (issue 35) -----------------------------------------------


def calls(*rows):
    from ddpkit.launch.hang.mismatch import Call

    return [Call(*row) for row in rows]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (  # a broadcast where the others all-reduce
            [(0, "all_reduce", "t.py:9", "[8]", 3), (1, "broadcast", "t.py:7", "[8]", 3),
             (2, "all_reduce", "t.py:9", "[8]", 3)],
            "the ranks called different collectives: rank 1 broadcast #3 of [8] at t.py:7; "
            "ranks 0,2 all_reduce #3 of [8] at t.py:9",
        ),
        (  # the same collective, other shapes
            [(0, "all_reduce", "t.py:9", "[8]", 5), (1, "all_reduce", "t.py:9", "[16]", 5)],
            "the ranks called all_reduce with different shapes: rank 1 all_reduce #5 of [16] "
            "at t.py:9; rank 0 all_reduce #5 of [8] at t.py:9",
        ),
        (  # one collective more on rank 3: it waits in the next one
            [(0, "all_reduce", "t.py:9", "[8]", 6), (1, "all_reduce", "t.py:9", "[8]", 6),
             (2, "all_reduce", "t.py:9", "[8]", 6), (3, "all_reduce", "t.py:9", "[8]", 7)],
            "the ranks called different numbers of collectives (each waits in another "
            "all_reduce): rank 3 all_reduce #7 of [8] at t.py:9; ranks 0-2 all_reduce #6 of [8] "
            "at t.py:9",
        ),
        (  # another node's ranks come as places only (no shapes, no sequence numbers)
            [(0, "all_reduce", "t.py:9"), (1, "barrier", "t.py:12")],
            "the ranks called different collectives: rank 1 barrier at t.py:12; rank 0 "
            "all_reduce at t.py:9",
        ),
    ],
)  # fmt: skip
def test_ranks_in_different_collectives_are_named_by_group(rows, expected):
    from ddpkit.launch.hang.mismatch import find

    assert find(calls(*rows)).line == expected


@pytest.mark.parametrize(
    "rows",
    [
        [(0, "all_reduce", "t.py:9", "[8]", 3), (1, "all_reduce", "t.py:9", "[8]", 3)],
        [(0, "all_reduce", "t.py:9", "", None), (1, "all_reduce", "t.py:9", "[8]", 4)],
        [(0, "all_reduce", "t.py:9", "[8]", 3)],
    ],
)
def test_ranks_waiting_in_the_same_collective_are_no_mismatch(rows):
    from ddpkit.launch.hang.mismatch import find

    assert find(calls(*rows)) is None


def test_a_rank_doing_something_else_is_no_mismatch_of_collectives():
    from ddpkit.launch.hang.places import calls_of

    places = {
        0: Place(Doing.WAITS_IN, "t.py:9", op="all_reduce"),
        1: Place(Doing.ELSEWHERE, "t.py:20", func="evaluate"),
    }
    assert calls_of(places, {}) is None


def test_the_fix_points_at_the_branch_on_the_rank_not_another_branch(tmp_path):
    from ddpkit.launch.hang.mismatch import Mismatch, fix_line

    (tmp_path / "train.py").write_text(
        "import torch.distributed as dist\n"
        "for step, batch in enumerate(loader):\n"
        "    if step % 100 == 0:\n"
        "        if master_process:\n"
        "            dist.barrier()\n"
        "    if mode == 'rank-ish':\n"
        "        dist.all_reduce(batch)\n"
    )  # fmt: skip
    found = Mismatch("x", [0], ["train.py:5", "train.py:7"])
    assert fix_line(found, [tmp_path]).endswith(
        "look at the branch at train.py:4 (`if master_process:`)"
    )
    neither = Mismatch("x", [0], ["train.py:7"])
    assert "look at the branch" not in fix_line(neither, [tmp_path]), "a string is not a rank"


# -- a GPU that never finishes (issue 35) ------------------------------------------------------


def test_a_gpu_rank_standing_in_one_call_waits_for_its_gpu():
    from ddpkit.launch.hang.places import gpu_wait

    now = 1000.0
    still = protocol.Record(ticked=now, still=now - 30, gpu="d1c6a2f0-0000")
    said = gpu_wait(still, now)
    # here without NVML (CI): the GPU's utilisation cannot be read, and the verdict says so
    assert said.doing is Doing.WAITS_FOR_GPU
    assert said.seconds == 30
    assert said.words().startswith(
        ("waits for its GPU, for 30 s with no step ended", "waits for GPU")
    )


@pytest.mark.parametrize(
    "record",
    [
        protocol.Record(ticked=1000.0, still=999.0, gpu="d1c6"),  # a short call: 1 s
        protocol.Record(ticked=1000.0, still=0.0, gpu="d1c6"),  # its thread moves
        protocol.Record(ticked=1000.0, still=900.0, gpu=""),  # a CPU rank waiting in C
        # in a (gloo) collective: waits for a peer, even while its GPU reads busy
        protocol.Record(0, 0, 950.0, True, "all_reduce", ticked=1000.0, still=950.0, gpu="d1"),
        None,
    ],
)
def test_a_moving_or_cpu_rank_does_not_wait_for_a_gpu(record):
    from ddpkit.launch.hang.places import gpu_wait

    assert gpu_wait(record, 1000.0) is None


def test_a_gpu_rank_with_nccls_kernel_started_waits_in_the_collective_not_for_its_gpu():
    stack = [Frame("/home/me/train.py", 30, "<module>")]
    gpu = Place(Doing.WAITS_FOR_GPU, seconds=40, gpu=0, busy=100)
    assert where(stack, None, None, "nccl:all_reduce #6 (started)", True, gpu) == Place(
        Doing.WAITS_IN, "train.py:30", op="all_reduce"
    )
    # queued behind the rank's own kernel: its GPU's work is what never ends
    behind = where(stack, None, None, "nccl:all_reduce #6 (scheduled)", True, gpu)
    assert behind == gpu.at("train.py:30")
    assert behind.words() == "waits for GPU 0, busy for 40 s with no step ended (100% utilised)"


# -- a long wait for a working rank: who waits ------------------------------------------------


def watch_with_quiet(quiet: dict[int, float], now: float = 1000.0):
    from ddpkit.launch.hang.progress_watch import RankState, Watch, _long_wait

    watch = Watch(
        timeout=4.0, ranks={r: RankState(last_progress=now - q) for r, q in quiet.items()}
    )
    return _long_wait(watch, now, wall=now)


def test_a_long_wait_names_every_waiting_rank_not_only_the_first_past_the_threshold():
    # rank 1 reached the wait 4.5 s ago, rank 0 a busy sample later: both wait for rank 2
    waits = watch_with_quiet({0: 3.2, 1: 4.5, 2: 0.5})
    assert (waits.waiting, waits.working) == ([0, 1], [2])


def test_no_long_wait_is_said_before_one_rank_waited_the_threshold():
    assert watch_with_quiet({0: 3.2, 1: 3.9, 2: 0.5}) is None


# -- a tick that is late but not yet decisive holds the hang verdict ---------------------------


def stalled_job(ticked_ago: float, now: float = 1000.0, held_since: float = 0.0):
    """Ranks 0 and 2 wait in all_reduce; rank 1's tick is `ticked_ago` s old. No rank has
    made progress for 6 s against a hang timeout of 4 s; the verdict held since `held_since`."""
    from ddpkit.launch.base.snapshot import RankView, Snapshot
    from ddpkit.launch.hang.progress_watch import RankState, Seen, Watch, judge

    waiting = protocol.Record(1, 0, now - 6, True, "all_reduce", ticked=now)
    views = tuple(
        RankView(rank=r, pid=100 + r, phase="ready", cpu=1.0, io=0,
                 record=protocol.Record(ticked=now - ticked_ago) if r == 1 else waiting)
        for r in range(3)
    )  # fmt: skip
    watch = Watch(
        timeout=4.0,
        ranks={
            v.rank: RankState(cpu=1.0, io=0, record=v.record, last_progress=now - 6) for v in views
        },
        last_sample=now - 1,
        next_flight=float("inf"),  # no flight recorder to ask
        held_since=held_since,
    )
    return judge(watch, Snapshot(views, wall=now, mono=now, sampled=True), Seen())[1].hung


@pytest.mark.parametrize("ticked_ago", [2.0, 4.0, 5.0])
def test_a_hang_is_not_judged_while_a_ranks_tick_is_late_but_not_yet_decisive(ticked_ago):
    # judged now, rank 1 (stuck in C code holding its GIL) would be placed 'elsewhere'
    assert not stalled_job(ticked_ago)


@pytest.mark.parametrize("ticked_ago", [0.3, 5.5, 60.0])
def test_a_hang_is_judged_once_every_ranks_tick_is_fresh_or_decisively_stale(ticked_ago):
    assert stalled_job(ticked_ago)


def test_a_tick_kept_late_without_end_holds_the_verdict_no_longer_than_a_tick_could_need():
    # a machine so starved that the tick stays 2 s late at every look: the verdict comes 3.5 s
    # after it was first held (the tick would have been decisive by then)
    assert not stalled_job(2.0, now=1000.0, held_since=997.0)
    assert stalled_job(2.0, now=1000.0, held_since=996.4)


# -- a place is a value: another node reads it, the report's advice follows it ---------------


@pytest.mark.parametrize(
    "place",
    [
        Place(Doing.EXITED, code=0),
        Place(Doing.WAITS_IN, "train.py:9", op="all_reduce"),
        Place(Doing.WAITS_FOR_GPU, "t.py:3", seconds=41.5, gpu=0, busy=100),
        Place(Doing.STOPPED, "t.py:3", pid=4242),
    ],
)
def test_a_place_crosses_to_another_node_unchanged(place):
    import json

    assert Place.from_json(json.loads(json.dumps(place.as_json()))) == place


def test_the_hang_advice_follows_the_places_not_the_words_of_the_summary():
    from ddpkit.launch import diagnosis
    from ddpkit.launch.hang.window import Window

    def fix(verdict: str, *where: Place) -> str:
        window = Window(300, 20, 300)
        hang = diagnosis.Hang(dict(enumerate(where)), verdict, "", stall=300, window=window)
        return diagnosis.hung(hang).fix

    gpu = Place(Doing.WAITS_FOR_GPU, seconds=40, gpu=0, busy=100)
    ended = Place(Doing.EXITED, code=0)
    waiting = Place(Doing.WAITS_IN, "t.py:9", op="all_reduce")
    assert "a GPU kernel never finished" in fix("x", gpu, waiting)
    assert "uneven inputs" in fix("x", ended, waiting)
    plain = fix("waits for GPU 0; has exited (code 0)", waiting)
    assert "GPU kernel" not in plain
    assert "uneven" not in plain


def test_several_ranks_in_one_place_are_said_with_a_plural_verb():
    stuck = Place(Doing.HOLDS_GIL, "t.py:3", seconds=6, func="match")
    assert (
        verdict({0: stuck, 1: stuck}) == "ranks 0,1 hold the GIL in C code for 6 s: match (t.py:3)"
    )
    assert verdict({2: Place(Doing.EXITED, code=0)}) == "rank 2 has exited (code 0)"


# -- the watch is a step function: (state, snapshot, what the edge read) -> (state, finding) ----


def looks(seconds: int, seen=None, timeout: float = 4.0):
    """Three ranks waiting in all_reduce, looked at once a second: each look's finding."""
    from ddpkit.launch.base.snapshot import RankView, Snapshot
    from ddpkit.launch.hang.progress_watch import Seen, Watch, judge

    waiting = protocol.Record(1, 0, 990.0, True, "all_reduce")
    watch, found = Watch(timeout=timeout), []
    for t in range(seconds):
        views = tuple(RankView(r, 100 + r, cpu=1.0, io=0, record=waiting) for r in range(3))
        snap = Snapshot(views, wall=1000.0 + t, mono=1000.0 + t, sampled=True)
        watch, finding = judge(watch, snap, seen or Seen())
        found.append(finding)
    return found


def test_the_hang_watch_finds_a_hang_once_no_rank_progressed_for_its_timeout():
    found = looks(7)
    assert [f.hung for f in found] == [False] * 4 + [True] * 3  # seen at 0 s, hung from 4 s
    assert found[-1].stall == 6


def test_another_nodes_progress_keeps_the_hang_watch_from_a_verdict():
    from ddpkit.launch.hang.progress_watch import Seen

    assert not any(f.hung for f in looks(7, Seen(remote_progress=1005.0)))


def test_a_judged_state_is_a_new_value_the_old_one_unchanged():
    from ddpkit.launch.base.snapshot import RankView, Snapshot
    from ddpkit.launch.hang.progress_watch import RankState, Seen, Watch, judge

    before = Watch(timeout=4.0, ranks={0: RankState(cpu=0.0, io=0, last_progress=990.0)})
    snap = Snapshot(
        (RankView(0, 100, cpu=5.0, io=0, answers=True),), wall=1000.0, mono=1000.0, sampled=True
    )
    after, finding = judge(before, snap, Seen())
    assert before.ranks[0].last_progress == 990.0
    assert after.ranks[0].last_progress == 1000.0, "5 CPU-s in a second: busy"
    assert finding.progressed
    assert finding.ask_flight == (0,), "the edge asks its flight recorder for the next poll"
