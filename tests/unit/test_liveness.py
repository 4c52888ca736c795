"""Node liveness decisions against a real TCPStore in this process: a node whose beats stop is
named by node 0 and the other nodes read why; a node that loses the store names node 0; an
abort record in the store reaches every node. The same decisions across network namespaces
are in tests/multinode."""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpkit.launch.peers.liveness import BEAT, Abort, Liveness
from ddpkit.launch.peers.nodes import NodeGroup
from ddpkit.launch.peers.store import BoundedStore

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 2.0
HOSTS = ["alpha", "beta"]


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    for node in range(len(HOSTS)):  # as registration leaves them (ddpkit.launch.peers.nodes)
        for counter in ("beat", "progress", "done"):
            store.add(f"job/{counter}/{node}", 0)
    yield store
    del store


def _node(rank: int, port: int) -> NodeGroup:
    return NodeGroup(
        group_rank=rank,
        nnodes=2,
        master_addr="127.0.0.1",
        master_port=port,
        hosts=HOSTS,
        store=BoundedStore("127.0.0.1", port, TIMEOUT, "job/"),
    )


# node 0 has looked at the other nodes this many times after the node timeout had passed
PAST_TIMEOUT = int(TIMEOUT / BEAT) + 2


def _beating(*nodes: Liveness) -> None:
    assert _until(lambda: all(n.beats >= 2 for n in nodes), 10), "the beat threads never ran"


def _looked_past_timeout(node: Liveness) -> None:
    start = node.beats
    assert _until(lambda: node.beats >= start + PAST_TIMEOUT, PAST_TIMEOUT * BEAT + 5)


def _until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_nodes_that_beat_are_not_lost(server):
    nodes = [Liveness(_node(r, server.port), TIMEOUT) for r in (0, 1)]
    for n in nodes:
        n.start()
    _beating(*nodes)
    _looked_past_timeout(nodes[0])
    for n in nodes:
        n.stop()
    assert [n.lost for n in nodes] == [None, None]


def test_a_node_whose_beats_stop_is_named_by_node_0_and_the_others_read_why(server):
    first, second = (Liveness(_node(r, server.port), TIMEOUT) for r in (0, 1))
    first.start()
    second.start()
    _beating(first, second)
    second.stop()  # node 1's launcher is gone: no more beats
    began = time.monotonic()
    assert _until(lambda: first.lost is not None, TIMEOUT + 3)
    assert time.monotonic() - began < TIMEOUT + 2.5
    first.stop()
    assert first.lost.startswith("node 1 (beta) is gone")
    assert "--node-timeout 2" in first.lost
    # what a node still running reads: the same words, from the store
    reader = Liveness(_node(1, server.port), TIMEOUT)
    reader.start()
    assert _until(lambda: reader.abort is not None, 3)
    reader.stop()
    assert reader.abort == Abort(0, first.lost, 1, restart=False)


def test_a_node_that_gets_no_answer_from_the_store_names_node_0():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: nothing answers there
        watcher = Liveness(_node(1, port), TIMEOUT)
        watcher.start()
        assert _until(lambda: watcher.lost is not None, TIMEOUT + 6)
        watcher.stop()
    assert watcher.lost.startswith("node 0 (alpha) is gone: the job's store at 127.0.0.1:")
    assert f"has not answered for {TIMEOUT:g} s" in watcher.lost


def test_a_node_that_finished_is_not_lost_when_its_beats_stop(server):
    first, second = (Liveness(_node(r, server.port), TIMEOUT) for r in (0, 1))
    first.start()
    second.start()
    _beating(first, second)
    second.stop()
    BoundedStore("127.0.0.1", server.port, TIMEOUT, "job/").add("done/1", 1)
    assert _until(first.all_done.is_set, 3)
    _looked_past_timeout(first)
    first.stop()
    assert first.lost is None


def test_a_forged_abort_record_is_ignored_and_said_once(server, monkeypatch, capsys):
    from ddpkit.cli import _log_to_stderr

    _log_to_stderr("warning")  # as the CLI sets ddpkit's loggers up
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "s3cret")
    forged = '{"abort": "{\\"node\\": 0, \\"why\\": \\"x\\", \\"code\\": 1, \\"restart\\": false}"}'
    BoundedStore("127.0.0.1", server.port, TIMEOUT, "job/").set("abort", forged)
    watcher = Liveness(_node(1, server.port), TIMEOUT)
    watcher.start()
    said: list[str] = []
    assert _until(lambda: said.append(capsys.readouterr().err) or "was not signed" in said[-1], 3)
    assert said[-1].startswith("ddpkit: warning: ignored a stop request"), said
    watcher.stop()
    assert watcher.abort is None
    logging.getLogger("ddpkit").handlers.clear()  # the handler holds this test's stderr


def test_each_features_channel_rides_the_beats_with_keys_of_its_own(server):
    # the hang doctor's ask, the speed doctor's summaries and `ddpkit profile`'s plan, between
    # two nodes' beat threads over a real store: Liveness knows none of their keys
    from ddpkit.launch.hang import across_nodes
    from ddpkit.launch.peers.peers import NodePeers
    from ddpkit.launch.peers.profile_relay import ASK_KEY, PlansChannel
    from ddpkit.launch.speed import across_nodes as speed_across

    peers = []
    for r in (0, 1):
        node = _node(r, server.port)
        channels = (
            across_nodes.PlacesChannel(node),
            speed_across.SummariesChannel(node),
            PlansChannel(),
        )
        peers.append(NodePeers(node, Liveness(node, TIMEOUT, channels=channels)))
    for p in peers:
        p.start()
    try:
        zero, one = peers
        speed_across.send(one, '[{"rank": 3}]')
        speed_across.send(zero, "node 0 sends nothing: it decides")
        server.set("job/" + across_nodes.ASK, "1")
        server.set("job/" + ASK_KEY, '{"id": "p1"}')
        assert _until(lambda: speed_across.from_others(zero) == ['[{"rank": 3}]'], 10)
        assert _until(lambda: across_nodes.asked(one), 10)
        assert not across_nodes.asked(one), "asked once per round"
        assert not across_nodes.asked(zero), "node 0 asks; it is not asked"
        plans = one.channel(PlansChannel)
        assert _until(lambda: plans.asks == ['{"id": "p1"}'], 10)
    finally:
        for p in peers:
            p.live.stop()
