"""Whether the job's other nodes are still there, known without ever blocking the launcher.

Every launcher adds one to its own counter in the job's store every BEAT seconds, through a
client of its own (a thread here). Node 0, which serves the store, reads every node's counters
in one call per beat; a node whose counter has not moved for `--node-timeout` is gone, and node
0 publishes why in the `abort` key. Every other node reads only that key and writes only its
own counters, so its cost does not grow with the number of nodes. A node that gets no answer
from the store for `--node-timeout` (node 0's launcher killed, its machine gone, the link cut)
has lost node 0 and says so in the same words. Every call is bounded (`ddpkit.launch.peers.store`).

The same thread carries the cross-node hang watch's traffic: each node adds to its `progress`
counter when one of its ranks progressed; node 0 knows when any node last did, and asks every
node where its ranks are (`hang/ask`) before it calls the job hung. And `ddpkit profile`'s
plan: every node reads the newest one (`profile/ask`) each beat and hands it to its launcher.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ddpkit.launch.base.decide import goes_on
from ddpkit.launch.peers import keys
from ddpkit.launch.peers.nodes import CALL_LIMIT, NodeGroup
from ddpkit.launch.peers.store import BoundedStore, StoreUnreachableError, bounded

BEAT = 1.0
log = logging.getLogger(__name__)


class Channel(Protocol):
    """A feature's traffic with the other nodes (the hang doctor's places, the speed doctor's
    summaries, `ddpkit profile`'s plans), carried by the beat thread so that the launcher's
    loop never waits on another node: at each beat the channel is handed the round's bounded
    store, this node's number and the beat's count, reads and writes its own keys, and keeps
    what it heard for the loop. Liveness knows no feature's keys."""

    def beat(self, store: BoundedStore, node: int, beats: int) -> None: ...


@dataclass(frozen=True)
class Abort:
    """Why the job stops on every node, published by the node that knows."""

    node: int
    why: str
    code: int  # exit code for the nodes that stop because of it
    restart: bool  # the nodes may meet again for another round (--max-restarts)
    membership: bool = False  # nodes wait to join (--nnodes MIN:MAX): a new round, no failure

    def to_json(self) -> str:
        """The record, signed with DDPKIT_JOB_TOKEN when the nodes share one."""
        body = json.dumps(self.__dict__, sort_keys=True)
        return json.dumps({"abort": body, "sig": _sign(body)})

    @classmethod
    def from_json(cls, text: str) -> Abort | None:
        """The record, or None when it is not one of this job's launchers' (bad signature)."""
        try:
            outer = json.loads(text)
            body, sig = outer["abort"], outer.get("sig")
            if not hmac.compare_digest(str(sig), _sign(body)):
                return None
            return cls(**json.loads(body))
        except (ValueError, KeyError, TypeError):
            return None


# the variable holding a secret every node of a job shares; abort records must carry it
TOKEN_VARIABLE = "DDPKIT_JOB_TOKEN"  # noqa: S105 - a variable's name, not a secret


def _sign(body: str) -> str:
    token = os.environ.get(TOKEN_VARIABLE, "")
    if not token:
        return ""
    return hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()


class Liveness:
    """The beat thread of one node for one round."""

    def __init__(
        self,
        node: NodeGroup,
        timeout: float,
        elastic: bool = False,
        min_nodes: int = 0,
        restarts_left: int = 0,
        channels: Sequence[Channel] = (),
    ) -> None:
        self.node = node
        self.channels = tuple(channels)
        self.timeout = timeout
        self.elastic = elastic  # node 0 asks the rendezvous whether nodes wait to join
        # a lost node: the others go on when at least min_nodes are left and a restart is
        self.min_nodes = min_nodes  # 0: not elastic
        self.restarts_left = restarts_left
        self.lost: str | None = None  # a node is gone (set once)
        self.lost_goes_on = False  # ... and the nodes left go on without it
        self.abort: Abort | None = None  # what some node published
        self.last_remote_progress = time.monotonic()  # node 0: any other node's ranks progressed
        self.beats = 0
        self.longest_gap = 0.0  # the longest time between two answered beats (measured)
        self._progressed = False
        self._said_forged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ddpkit-liveness")
        self._done_nodes: set[int] = set()
        self.all_done = threading.Event()

    def start(self) -> None:
        # an elastic job of one node so far still watches for nodes that want to join
        if self.node.store is not None and (self.node.multi_node or self.elastic):
            self._thread.start()

    def stop(self, wait: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(wait)

    def progressed(self) -> None:
        """A rank of this node made progress (told by the hang watch, each sample)."""
        self._progressed = True

    def _run(self) -> None:
        node = self.node
        assert node.store is not None  # start() runs the thread only with a store
        store = BoundedStore(
            node.store_addr, node.master_port, min(CALL_LIMIT, self.timeout), node.store.prefix
        )
        me = node.group_rank
        last_ok = time.monotonic()
        seen: dict[str, tuple[int, float]] = {}
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                store.add(keys.beat(me), 1)
                if self._progressed:
                    self._progressed = False
                    store.add(keys.progress(me), 1)
                if me == 0:
                    self._watch_nodes(store, seen)
                    if self.elastic and self.beats % 2 == 0:
                        self._watch_membership(store)
                for channel in self.channels:
                    channel.beat(store, me, self.beats)
                if self.abort is None and store.has(keys.ABORT):
                    self.abort = Abort.from_json(store.get(keys.ABORT))
                    if self.abort is None and not self._said_forged:
                        self._said_forged = True
                        log.warning(
                            "ignored a stop request in the job's store that was not signed "
                            "with this job's %s",
                            TOKEN_VARIABLE,
                        )
                now = time.monotonic()
                self.longest_gap = max(self.longest_gap, now - last_ok) if self.beats else 0.0
                self.beats += 1
                last_ok = now
            except StoreUnreachableError as err:
                if time.monotonic() - last_ok >= self.timeout and me != 0:
                    self.lost_goes_on, then = goes_on(
                        node.nnodes, self.min_nodes, self.restarts_left, node.hosts_rendezvous(0)
                    )
                    self.lost = (
                        f"node 0 ({node.host_of(0)}) is gone: the job's store at "
                        f"{node.master_addr}:{node.master_port} has not answered for "
                        f"{self.timeout:g} s ({err}){then}"
                    )
                    return
            if self.lost:
                return
            self._stop.wait(max(0.0, BEAT - (time.monotonic() - began)))

    def _watch_nodes(self, store: BoundedStore, seen: dict[str, tuple[int, float]]) -> None:
        """Node 0: every node's counters in one call; a counter that stopped is a lost node."""
        others = range(1, self.node.nnodes)
        names = [keys.counter(kind, n) for n in others for kind in keys.COUNTERS]
        values = dict(zip(names, store.counters(names), strict=True))
        now = time.monotonic()
        for name, value in values.items():
            last = seen.get(name)
            if last is None or value != last[0]:
                seen[name] = (value, now)
                if name.startswith(keys.progress(0)[:-1]) and last is not None:
                    self.last_remote_progress = now
        for n in others:
            if values[keys.done(n)]:
                self._done_nodes.add(n)
        if len(self._done_nodes) == self.node.nnodes - 1:
            self.all_done.set()
        for n in others:
            if n in self._done_nodes:
                continue
            stalled = now - seen[keys.beat(n)][1]
            if stalled >= self.timeout:
                self.lost_goes_on, then = goes_on(
                    self.node.nnodes,
                    self.min_nodes,
                    self.restarts_left,
                    self.node.hosts_rendezvous(n),
                )
                self.lost = (
                    f"node {n} ({self.node.host_of(n)}) is gone: its launcher has not answered "
                    f"for {stalled:.0f} s (--node-timeout {self.timeout:g}){then}"
                )
                # the other nodes stop (or meet again) for the same reason, in the same words
                abort = Abort(0, self.lost, 1, restart=self.lost_goes_on)
                try:
                    store.set(keys.ABORT, abort.to_json())
                except StoreUnreachableError:
                    pass
                return

    def _watch_membership(self, store: BoundedStore) -> None:
        """Node 0, elastic jobs: nodes waiting at the rendezvous mean a new round for all, as
        torchrun's agents do on `num_nodes_waiting() > 0`."""
        handler = self.node.rendezvous
        if handler is None or self.abort is not None:
            return
        try:
            waiting = int(bounded(handler.num_nodes_waiting, CALL_LIMIT, "asking the rendezvous"))
        except StoreUnreachableError:
            return
        if waiting:
            abort = Abort(0, f"{waiting} node(s) waiting to join", 0, True, membership=True)
            store.set(keys.ABORT, abort.to_json())
            self.abort = abort
