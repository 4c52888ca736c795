"""What the nodes of one job do together: stop for one reason, meet again for a restart, end
together.

All of it goes through the job's store on node 0, each call bounded. A node that fails
publishes an `Abort` (why, the exit code for the others, whether the nodes meet again); every
other node reads it within a beat (`ddpkit.launch.peers.liveness`). At the end, node 0 (and the node
that serves the rendezvous) wait for every node to say it is done before they take the stores
away, and the others stop talking to the stores before they say so: no node sees a store
vanish under it on a successful exit.
"""

from __future__ import annotations

import contextlib
import time

from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.peers import keys
from ddpkit.launch.peers.liveness import Abort, Liveness
from ddpkit.launch.peers.nodes import NodeGroup, register, serves_rendezvous
from ddpkit.launch.peers.rounds import join_rdzv
from ddpkit.launch.peers.store import StoreUnreachableError

EXIT_BARRIER = 300.0  # as torchrun's agents wait for each other at the end


def publish_abort(node: NodeGroup, abort: Abort, limit: float) -> None:
    """Tell every other node why the job stops (best effort, at most `limit` seconds)."""
    if node.store is None:
        return
    with contextlib.suppress(StoreUnreachableError):
        node.store.call("set", node.store.key(keys.ABORT), abort.to_json(), limit=limit)


def finish(node: NodeGroup, live: Liveness) -> None:
    """After this node's workers succeeded: leave without pulling a store from under anyone."""
    leave(node, live, EXIT_BARRIER)
    _shutdown_rendezvous(node)


def leave(node: NodeGroup, live: Liveness, wait: float, hurry: bool = False) -> None:
    """This node is done with the round (well or not). The nodes that serve a store wait, up
    to `wait` seconds, until every node has said so, so that no node loses the store before it
    has read why the job stops; the others stop talking to the stores, then say so. In a
    `hurry` (a signal stops the job) a store that did not answer this node's last call is not
    asked again: SIGTERM ends a node whose link is cut within its grace, not a call later."""
    if not node.multi_node or node.store is None:
        live.stop(0.5)
        return
    host = node.group_rank == 0 or serves_rendezvous(node)
    if not host:
        live.stop(0.5)
        if live.lost:  # node 0 is gone: there is no one to tell
            return
    if not (hurry and node.store.unreachable):
        with contextlib.suppress(StoreUnreachableError):
            done = node.store.key(keys.done(node.group_rank))
            node.store.call("add", done, 1, limit=min(wait, 5))
    if host:
        Wait(lambda: live.lost).until(lambda: _all_done(node), wait, poll=0.1)
        live.stop(0.5)


def _all_done(node: NodeGroup) -> bool:
    assert node.store is not None
    try:
        names = [keys.done(n) for n in range(node.nnodes)]
        return all(node.store.counters(names))
    except StoreUnreachableError:
        return False


def _shutdown_rendezvous(node: NodeGroup) -> None:
    handler, node.rendezvous = node.rendezvous, None
    if handler is not None:
        from ddpkit.launch.peers.store import bounded

        with contextlib.suppress(Exception):
            bounded(handler.shutdown, 5.0, "leaving the rendezvous")


def next_round(cfg: LaunchConfig, node: NodeGroup) -> NodeGroup:
    """Meet again after a failure: a new round of torch elastic's rendezvous (node ranks may
    change; node 0 serves a new store), or, with static nodes, a new round on the same store."""
    if node.rendezvous is not None:
        if node.store is not None:
            node.store.close()
        # the stores of earlier rounds live on until the job ends: no node loses one mid-call
        kept = [*node.kept, node.server] if node.server is not None else node.kept
        return join_rdzv(cfg, node.rendezvous, kept)
    node.round += 1
    if node.multi_node:  # one node has no one to meet (its rank 0 serves each round's store)
        register(node, cfg, time.monotonic() + cfg.init_timeout)
    return node
