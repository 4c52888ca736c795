"""The job's other nodes for one round, as membership: who is there, who is lost and whether
the others go on, why the job stops (an `Abort`), whether they progress, and leaving together.
`NodePeers` over the job's store (several nodes), `NoPeers` for a job of one node, where there
is nobody to tell and nobody to lose.

A feature that talks to the other nodes (the hang doctor's places, the speed doctor's
summaries, `ddpkit profile`'s plans) owns its keys and its traffic in a `Channel` of its own
module, carried by the beat thread; `channel(kind)` finds it (None with one node). Adding one
changes nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from ddpkit.launch.base.wait import Wait
from ddpkit.launch.peers import crossnode
from ddpkit.launch.peers.liveness import Abort, Channel, Liveness
from ddpkit.launch.peers.nodes import CALL_LIMIT, NodeGroup

Kind = TypeVar("Kind")


class Peers(Protocol):
    multi_node: bool
    leads: bool  # this node speaks for the job (node 0, or the only node): hangs, stragglers

    def start(self) -> None: ...
    def word(self) -> Abort | None: ...  # another node stopped the job (or nodes join)
    def lost(self) -> str | None: ...  # another node is gone (or node 0, to this one)
    def lost_goes_on(self) -> bool: ...  # ... and the nodes left go on (--nnodes MIN:MAX)
    def progressed(self) -> None: ...  # a rank of this node made progress
    def last_remote_progress(self) -> float | None: ...  # any other node's, monotonic
    def publish_abort(self, abort: Abort, hurry: bool) -> None: ...
    def channel(self, kind: type[Kind]) -> Kind | None: ...  # a feature's, None: one node
    def leave(self, seconds: float, hurry: bool) -> None: ...
    def finish(self) -> None: ...
    def debug_line(self) -> str: ...


class NoPeers:
    """A job of one node."""

    multi_node = False
    leads = True

    def start(self) -> None:
        pass

    def word(self) -> Abort | None:
        return None

    def lost(self) -> str | None:
        return None

    def lost_goes_on(self) -> bool:
        return False

    def progressed(self) -> None:
        pass

    def last_remote_progress(self) -> float | None:
        return None

    def publish_abort(self, abort: Abort, hurry: bool) -> None:
        pass

    def channel(self, kind: type[Kind]) -> Kind | None:
        return None

    def leave(self, seconds: float, hurry: bool) -> None:
        pass

    def finish(self) -> None:
        pass

    def debug_line(self) -> str:
        return ""


class NodePeers:
    """The job's other nodes, through its store on node 0 (every call bounded) and the beat
    thread (`Liveness`)."""

    multi_node = True

    def __init__(self, node: NodeGroup, live: Liveness) -> None:
        self.node = node
        self.live = live
        self.leads = node.group_rank == 0

    def start(self) -> None:
        self.live.start()

    def word(self) -> Abort | None:
        abort = self.live.abort
        if abort is not None and (abort.node != self.node.group_rank or abort.membership):
            return abort
        return None

    def lost(self) -> str | None:
        return self.live.lost

    def lost_goes_on(self) -> bool:
        return self.live.lost_goes_on

    def progressed(self) -> None:
        self.live.progressed()

    def last_remote_progress(self) -> float | None:
        return self.live.last_remote_progress

    def publish_abort(self, abort: Abort, hurry: bool) -> None:
        crossnode.publish_abort(self.node, abort, 0.5 if hurry else CALL_LIMIT)

    def channel(self, kind: type[Kind]) -> Kind | None:
        return next((c for c in self.live.channels if isinstance(c, kind)), None)

    def leave(self, seconds: float, hurry: bool) -> None:
        crossnode.leave(self.node, self.live, seconds, hurry=hurry)

    def finish(self) -> None:
        crossnode.finish(self.node, self.live)

    def debug_line(self) -> str:
        return f"liveness: {self.live.beats} beats, longest gap {self.live.longest_gap:.2f} s"


def peers_of(
    node: NodeGroup,
    node_timeout: float,
    elastic: bool,
    min_nodes: int = 0,
    restarts_left: int = 0,
    channels: Sequence[Channel] = (),
) -> Peers:
    """This round's peers: a beat thread over the store for several nodes (or an elastic job of
    one node so far, which watches for nodes that want to join), none for one node. A lost
    node leaves the others going on when at least `min_nodes` are left and a restart is. The
    features' `channels` ride on its beats."""
    if not node.multi_node and not (elastic and node.store is not None):
        return NoPeers()
    live = Liveness(node, node_timeout, elastic, min_nodes, restarts_left, channels)
    return NodePeers(node, live)


def wait_for_word(peers: Peers, wait: Wait, seconds: float) -> Abort | str | None:
    """This node's ranks failed only because a peer went away: wait (up to `seconds`) for the
    other nodes' word on why (their abort, or a lost node)."""
    found: list[Abort | str] = []

    def heard() -> bool:
        said = peers.word() or peers.lost()
        if said is not None:
            found.append(said)
        return bool(found)

    wait.until(heard, seconds)
    return found[0] if found else None


__all__ = ["NoPeers", "NodePeers", "Peers", "peers_of", "wait_for_word"]
