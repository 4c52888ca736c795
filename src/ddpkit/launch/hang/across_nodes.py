"""The hang doctor across nodes: node 0 asks every node where its ranks are, each node answers
with its ranks' places and stacks, and node 0 puts every node's into one verdict. The keys
(`hang/ask`, `hang/places/N`) are this module's; the ask is heard by the beat thread
(`PlacesChannel.beat`), so the launcher's loop never waits on another node for it.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from ddpkit.launch.base.place import Doing, Place
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.peers.nodes import NodeGroup
from ddpkit.launch.peers.peers import Peers
from ddpkit.launch.peers.store import BoundedStore, StoreUnreachableError

ASK = "hang/ask"  # node 0's question: every node, say where your ranks are
PLACES_WAIT = 15.0  # how long node 0 waits for the other nodes' stacks in a hang


def places_key(node: int) -> str:
    return f"hang/places/{node}"


class PlacesChannel:
    """One round's hang traffic of this node."""

    def __init__(self, node: NodeGroup) -> None:
        self.node = node
        self.heard = False  # node 0 asked (read by the beat thread)
        self._answered = False

    def beat(self, store: BoundedStore, node: int, beats: int) -> None:
        if node != 0 and not self.heard and store.has(ASK):
            self.heard = True

    def asked(self) -> bool:
        """Once per round: node 0 asked where this node's ranks are."""
        if self.heard and not self._answered:
            self._answered = True
            return True
        return False


def asked(peers: Peers) -> bool:
    channel = peers.channel(PlacesChannel)
    return channel is not None and channel.asked()


def answer(peers: Peers, places: dict[int, Place], details: str) -> None:
    """This node's ranks' places and stacks, for node 0's verdict."""
    channel = peers.channel(PlacesChannel)
    store = channel.node.store if channel is not None else None
    if channel is None or store is None:
        return
    record = {"places": {str(r): p.as_json() for r, p in places.items()}, "details": details}
    with contextlib.suppress(StoreUnreachableError):
        store.set(places_key(channel.node.group_rank), json.dumps(record))


def everywhere(
    peers: Peers, own: dict[int, Place], own_details: str, ranks_per_node: int, wait: Wait
) -> tuple[dict[int, Place], dict[int, str] | None, str]:
    """Node 0: every node's places, every rank's host, and the details text; a node that does
    not answer within PLACES_WAIT is named as such. One node: its own."""
    channel = peers.channel(PlacesChannel)
    node = channel.node if channel is not None else None
    if node is None or node.store is None or not node.multi_node:
        return own, None, own_details
    store = node.store
    with contextlib.suppress(StoreUnreachableError):
        store.set(ASK, "1")
    places, hosts = dict(own), dict.fromkeys(own, node.host_of(0))
    details = [f"  node 0 ({node.host_of(0)}):", own_details]
    waiting = set(range(1, node.nnodes))
    answers: dict[int, dict[str, Any]] = {}

    def every_node_answered() -> bool:
        for n in sorted(waiting):
            with contextlib.suppress(StoreUnreachableError):
                if store.has(places_key(n)):
                    answers[n] = json.loads(store.get(places_key(n)))
                    waiting.discard(n)
        return not waiting

    wait.until(every_node_answered, PLACES_WAIT, poll=0.2)
    for n in range(1, node.nnodes):
        first = n * ranks_per_node
        if n in answers:
            for rank, place in answers[n]["places"].items():
                places[int(rank)], hosts[int(rank)] = Place.from_json(place), node.host_of(n)
            details += [f"  node {n} ({node.host_of(n)}):", answers[n]["details"]]
        else:
            for rank in range(first, first + ranks_per_node):
                places[rank] = Place(Doing.NODE_SILENT)
                hosts[rank] = node.host_of(n)
            details.append(f"  node {n} ({node.host_of(n)}): did not say where its ranks are")
    return places, hosts, "\n".join(details)
