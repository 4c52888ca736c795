"""The launcher's decisions from the state files ranks write (real files in a real folder, in
the formats of ddpkit.common.protocol): which rank is the root cause, who never reached init, which
rank counts as failed while it is still tearing down, when a job starts again, and when a
failure is another node's. The same decisions end to end are in tests/e2e."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

from ddpkit.common import protocol
from ddpkit.launch import causes, observe, report
from ddpkit.launch.base.snapshot import ERROR_EXIT_WAIT
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.base.worker import Signals
from ddpkit.launch.peers.liveness import Abort, Liveness
from ddpkit.launch.peers.nodes import NodeGroup
from ddpkit.launch.peers.peers import NodePeers, wait_for_word
from tests.unit.snapshots import failed_outcome, look, worker


def error(state, rank: int, message: str, at: float, kind: str = "RuntimeError", code=None):
    protocol.write_error(state, rank, protocol.ErrorRecord(at, kind, message, exit_code=code))


def test_the_root_cause_is_the_first_error_that_is_not_a_lost_peer(tmp_path):
    now = time.time()
    error(tmp_path, 0, "Connection reset by peer", now - 2)  # earlier, but a victim's words
    error(tmp_path, 1, "shapes differ", now - 1, kind="ValueError")
    outcome = failed_outcome(look(tmp_path, [worker(0, 1), worker(1, 1)]))
    assert outcome.root_rank == 1
    assert outcome.summary.startswith("rank 1 ")
    assert "(ValueError: shapes differ)" in outcome.summary
    assert not outcome.victim


def test_when_every_failed_rank_lost_a_peer_the_cause_may_be_elsewhere(tmp_path):
    now = time.time()
    error(tmp_path, 0, "Connection closed by peer", now - 1)
    error(tmp_path, 1, "Connection reset by peer", now - 2)
    outcome = failed_outcome(look(tmp_path, [worker(0, 1), worker(1, 1)]))
    assert outcome.victim
    assert outcome.root_rank == 1, "the earliest of the victims"


def test_a_rank_without_an_error_record_is_placed_by_when_it_ended(tmp_path):
    now = time.time()
    outcome = failed_outcome(
        look(tmp_path, [worker(0, -signal.SIGKILL, now - 1), worker(1, 3, now - 5)])
    )
    assert outcome.root_rank == 1
    assert outcome.exit_code == 3


def test_ranks_that_never_reached_init_are_named_once_the_others_waited_the_timeout(tmp_path):
    began = time.time() - 10  # rank 0 entered init_process_group 10 s ago
    protocol.state_path(tmp_path, 0, protocol.PHASE).write_text(f"init {began:.3f}\n")
    protocol.write_phase(tmp_path, 1, "started")
    workers = [worker(0), worker(1), worker(2)]  # rank 2 wrote nothing yet
    assert observe.missing_at_init(look(tmp_path, workers), timeout=60) is None
    verdict = observe.missing_at_init(look(tmp_path, workers), timeout=5)
    assert verdict.missing == [1, 2]
    assert verdict.line == (
        "rank 1,2 never reached init_process_group; rank 0 waited 10 s for it (--init-timeout 5)"
    )


def test_no_init_verdict_while_no_rank_waits_in_init(tmp_path):
    protocol.write_phase(tmp_path, 0, "ready")
    protocol.write_phase(tmp_path, 1, "started")
    assert observe.missing_at_init(look(tmp_path, [worker(0), worker(1)]), timeout=0) is None


def test_a_rank_stuck_after_its_error_counts_as_failed_with_the_code_it_chose(tmp_path):
    error(tmp_path, 0, "boom", time.time(), code=7)
    error(tmp_path, 1, "boom", time.time())
    fresh = protocol.state_path(tmp_path, 1, protocol.ERROR)
    old = protocol.state_path(tmp_path, 0, protocol.ERROR)
    written = time.time() - ERROR_EXIT_WAIT - 1
    os.utime(old, (written, written))
    workers = [worker(0), worker(1), worker(2, exit_code=0)]
    snap = look(tmp_path, workers)
    assert observe.failed(snap) == (0,), f"{fresh.name} was written just now"
    stuck = {v.rank: v for v in snap.failed_ranks}
    assert list(stuck) == [0]
    assert stuck[0].code == 7, "the code its error chose"
    assert stuck[0].exit_code is None, "its exit code is its own, when it comes"
    assert workers[0].exit_code is None, "nothing is written into the worker"


def in_collective(state, rank: int) -> None:
    protocol.RecordWriter(protocol.state_path(state, rank, protocol.PROGRESS)).enter(
        "all_reduce", "[16]", "train.py:20"
    )


def test_a_rank_still_in_a_collective_has_not_landed_while_every_failed_rank_lost_a_peer(tmp_path):
    error(tmp_path, 2, "Connection closed by peer", time.time())
    in_collective(tmp_path, 1)  # it lost the same peer, and is slower to say so
    workers = [worker(0, exit_code=0), worker(1), worker(2, exit_code=1)]
    assert not observe.settled(look(tmp_path, workers))
    workers[1].exit_code = 1
    assert observe.settled(look(tmp_path, workers))


def test_a_rank_that_failed_for_itself_settles_at_once(tmp_path):
    error(tmp_path, 2, "shapes differ", time.time(), kind="ValueError")
    in_collective(tmp_path, 1)  # waits for rank 2, which will never come
    assert observe.settled(look(tmp_path, [worker(0), worker(1), worker(2, exit_code=1)]))


def test_a_live_rank_outside_any_collective_is_not_waited_for(tmp_path):
    error(tmp_path, 2, "Timed out waiting 6000ms", time.time())
    protocol.RecordWriter(protocol.state_path(tmp_path, 1, protocol.PROGRESS))  # evaluating
    assert observe.settled(look(tmp_path, [worker(0), worker(1), worker(2, exit_code=1)]))


def test_a_victim_node_hears_the_other_nodes_word():
    node = NodeGroup(group_rank=1, nnodes=2)
    live = Liveness(node, timeout=1)  # not started: its findings are set as the thread would
    live.abort = Abort(0, "rank 0 exited with code 3", 3, restart=False)
    word = wait_for_word(NodePeers(node, live), Wait(), seconds=1)
    assert word == live.abort
    outcome = report.Outcome.other_node(word)
    assert (outcome.summary, outcome.exit_code, outcome.from_node) == (live.abort.why, 3, 0)


def test_a_victim_node_hears_nothing_when_no_word_comes_and_keeps_its_verdict():
    node = NodeGroup(group_rank=1, nnodes=2)
    began = time.monotonic()
    assert wait_for_word(NodePeers(node, Liveness(node, 1)), Wait(), seconds=0.2) is None
    assert time.monotonic() - began >= 0.2


def test_a_lost_node_is_heard_as_such():
    node = NodeGroup(group_rank=1, nnodes=2)
    live = Liveness(node, timeout=1)
    live.lost = "node 0 (alpha) is gone"
    word = wait_for_word(NodePeers(node, live), Wait(), seconds=1)
    outcome = report.Outcome.node_lost(word)
    assert (outcome.summary, outcome.restartable) == ("node 0 (alpha) is gone", False)


def test_a_nodes_own_abort_is_not_another_nodes_word():
    node = NodeGroup(group_rank=1, nnodes=2)
    live = Liveness(node, timeout=1)
    live.abort = Abort(1, "this node's own verdict", 1, restart=False)
    assert NodePeers(node, live).word() is None
    live.abort = Abort(1, "nodes join", 0, restart=True, membership=True)
    assert NodePeers(node, live).word() is not None, "a membership change is everyone's"


def test_a_wait_gives_up_at_once_on_a_stop_signal():
    signals = Signals(count=1, last=signal.SIGTERM)
    waited = Wait(lambda: "SIGTERM" if signals.count else None).until(lambda: False, 30)
    assert (waited.done, waited.why) == (False, "SIGTERM")


def test_every_rank_inside_init_past_the_init_timeout_is_a_verdict_too(tmp_path):
    # issue 35: the ranks all came, and init never completed (a store of the script's own)
    began = time.time() - 10
    for rank in (0, 1):
        protocol.state_path(tmp_path, rank, protocol.PHASE).write_text(f"init {began}\n")
    workers = [worker(0), worker(1)]
    said = observe.missing_at_init(look(tmp_path, workers), timeout=5)
    assert said.missing == []
    assert said.line.startswith("init_process_group did not complete: ranks 0,1 waited 10 s in it")
    assert observe.missing_at_init(look(tmp_path, workers), timeout=60) is None, "not yet"


def test_ranks_that_failed_the_same_way_at_once_are_named_by_the_lowest(tmp_path):
    now = time.time()
    error(tmp_path, 1, "world_size=4 but this is rank 1", now - 1.0, kind="InitMismatchError")
    error(tmp_path, 0, "world_size=4 but this is rank 0", now - 0.8, kind="InitMismatchError")
    outcome = failed_outcome(look(tmp_path, [worker(0, 1), worker(1, 1)]))
    assert outcome.root_rank == 0, "the same error within a second: the lowest rank names it"


def test_a_victims_one_line_is_its_errors_first_sentence_without_cpp_file():
    from ddpkit.rank.failure import first_sentence

    message = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:20380. This is typically caused by a remote worker crashing."
    )
    assert first_sentence(message) == "Connection closed by peer [127.0.0.1]:20380."


def oom_watch(tmp_path, kills_since_start):
    """The OOM watch of a memory cgroup (its files as the kernel writes them, limit 3 GiB)."""
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{3 * 2**30}\n")
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 0\n")
    watch = causes.OomWatch()
    watch.folder, watch.kills = cgroup, causes.oom_kills(cgroup)
    text = f"low 0\nhigh 0\nmax 40\noom 2\noom_kill {kills_since_start}\n"
    (cgroup / "memory.events").write_text(text)
    return watch


def two_killed_at_once(tmp_path):
    """Rank 0 (367 MiB) reaped a moment before rank 1 (1.06 GiB), both SIGKILLed."""
    now = time.time()
    snap = look(tmp_path, [worker(0, -signal.SIGKILL, now), worker(1, -signal.SIGKILL, now + 0.01)])
    held = {0: 367 * 2**20, 1: int(1.06 * 2**30)}
    return replace(snap, ranks=tuple(replace(v, rss=held[v.rank]) for v in snap.ranks))


def test_of_ranks_the_oom_killer_ended_at_once_the_one_that_held_most_is_the_cause(tmp_path):
    outcome = failed_outcome(two_killed_at_once(tmp_path), oom_watch(tmp_path, 2))
    assert outcome.root_rank == 1
    assert outcome.summary == (
        "rank 1 was killed by the kernel's OOM killer: the job's memory cgroup (limit 3 GiB) ran "
        "out of memory; its processes last held 1.06 GiB; rank 0 was SIGKILLed the same moment (it "
        "held 367 MiB)"
    ), outcome.summary


def test_ranks_killed_at_once_without_an_oom_kill_are_named_by_who_ended_first(tmp_path):
    outcome = failed_outcome(two_killed_at_once(tmp_path), oom_watch(tmp_path, 0))
    assert outcome.root_rank == 0
    assert outcome.summary == "rank 0 died of SIGKILL", outcome.summary
