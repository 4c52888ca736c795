"""The speed doctor across nodes: every node but node 0 sends its ranks' step summaries, node 0
reads every other node's and decides for the job. The keys (`speed/N`) are this module's; the
beat thread carries them (`SummariesChannel.beat`), every other beat, so that the launcher's
loop never waits on another node."""

from __future__ import annotations

from ddpkit.launch.peers.nodes import NodeGroup
from ddpkit.launch.peers.peers import Peers
from ddpkit.launch.peers.store import BoundedStore


def summaries_key(node: int) -> str:
    return f"speed/{node}"


class SummariesChannel:
    """This node's summaries (JSON) to send, and node 0's copy of every other node's."""

    def __init__(self, node: NodeGroup) -> None:
        self.nnodes = node.nnodes
        self.out: str | None = None
        self.got: dict[int, str] = {}

    def beat(self, store: BoundedStore, node: int, beats: int) -> None:
        if node == 0 and beats % 2 == 1:
            for n in range(1, self.nnodes):
                if store.has(summaries_key(n)):
                    self.got[n] = store.get(summaries_key(n))
        elif node != 0 and self.out is not None and beats % 2 == 0:
            store.set(summaries_key(node), self.out)
            self.out = None


def send(peers: Peers, summaries: str) -> None:
    """A node other than node 0: these summaries go to node 0 at a coming beat."""
    channel = peers.channel(SummariesChannel)
    if channel is not None and not peers.leads:
        channel.out = summaries


def from_others(peers: Peers) -> list[str]:
    """Node 0: the newest summaries of every other node."""
    channel = peers.channel(SummariesChannel)
    return list(channel.got.values()) if channel is not None else []
