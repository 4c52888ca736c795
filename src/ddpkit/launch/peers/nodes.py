"""How the launchers of a job's nodes meet and agree where the job's store is.

One node: nothing to meet; the launcher holds a loopback port for the workers' store. Several
nodes meet either through torch elastic's c10d rendezvous (`--rdzv HOST:PORT`, the engine
torchrun uses; node ranks come from it) or statically (`--node-rank K --master-addr HOST
--master-port P`, also what `srun ddpkit run` uses). Node 0 then serves the job's store (the
workers' store and the launchers' keys), on the address the other nodes reach it by, and
publishes address and port as one record; every rank of every node gets that pair as
MASTER_ADDR/MASTER_PORT. Before any worker starts, every node has connected to that store and
said who it is, or the launcher stops with the node that could not and why.

The way in (`join`), rounds of the rendezvous, and a round that came apart:
`ddpkit.launch.peers.rounds`. Liveness
and the end of a job: `ddpkit.launch.peers.liveness`. Every store call is bounded
(`ddpkit.launch.peers.store`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddpkit.common.network import is_loopback
from ddpkit.errors import ConfigError, LaunchError
from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.ports import listen
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.peers import keys
from ddpkit.launch.peers.store import BoundedStore, StoreUnreachableError, bounded, serve

if TYPE_CHECKING:  # torch is imported only when a store or a rendezvous is made
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler

log = logging.getLogger(__name__)
CALL_LIMIT = 5.0  # seconds any one launcher store call may take once the job runs


# the meeting's keys in the job's store (node 0 writes the run id; every node its registration;
# the round's decision is set once: "ready" or why it came apart)
RUN_ID = "run_id"
READY_KEY = "ready"


def round_prefix(round: int) -> str:
    """Where one round's keys live: a restart is a new round on the same store."""
    return f"ddpkit/{round}/"


def registration(node: int) -> str:
    return f"node/{node}"


@dataclass
class NodeGroup:
    """This node's place among the job's nodes, for one round (a restart is a new round)."""

    group_rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_id: str = ""
    round: int = 0
    hosts: list[str] = field(default_factory=list)  # hostname of each node, by node rank
    store: BoundedStore | None = None  # this thread's client of the job's store (several nodes)
    server: TCPStore | None = None  # the job's TCPStore, on the node that serves it
    held: socket.socket | None = None  # a single node's listening socket, not yet a store
    rendezvous: RendezvousHandler | None = None  # torch elastic's handler, with --rdzv
    rdzv_host: str = ""
    kept: list[TCPStore] = field(default_factory=list)  # stores of earlier rounds, kept to the end
    rendezvous_node: int | None = None  # the node that serves the rendezvous (--rdzv), if one

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def store_addr(self) -> str:
        """Where this node's own clients reach the job's store: loopback on the node that
        serves it (its advertised address may be one only the others route to)."""
        return "127.0.0.1" if self.server is not None else self.master_addr

    @property
    def host(self) -> str:
        return self.hosts[self.group_rank] if self.hosts else socket.gethostname()

    def host_of(self, node: int) -> str:
        return self.hosts[node] if node < len(self.hosts) else f"node {node}"

    def hosts_rendezvous(self, node: int) -> bool:
        """Node `node` is the machine the rendezvous endpoint names (each node says so of
        itself when it registers)."""
        return self.rendezvous_node == node

    def serve_store(self, timeout: float, wait: Wait) -> None:
        """On one node: turn the held port into the workers' store (once). The store's own
        client dials it on loopback (the port listens there whatever --master-addr is); the
        call runs on a thread, so a signal is answered while it does."""
        if self.server is not None or self.held is None:
            return
        held, self.held = self.held, None
        _, self.server = wait.call(lambda: serve(held, "127.0.0.1", timeout), timeout + 5)

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
            self.held = None
        if self.store is not None:
            self.store.close()
        self.server, self.kept, self.rendezvous = None, [], None


class RoundApartError(Exception):
    """This node's view of the rendezvous round is not the one the other nodes hold."""


def join_static(cfg: LaunchConfig) -> NodeGroup:
    rank = cfg.node_rank or 0
    resolve(cfg.master_addr)
    node = NodeGroup(group_rank=rank, nnodes=cfg.nnodes, master_addr=cfg.master_addr)
    deadline = time.monotonic() + cfg.init_timeout
    if rank == 0:
        serve_job_store(node, cfg, cfg.master_addr)
        node.master_port = cfg.master_port
    else:
        node.master_port = cfg.master_port
    register(node, cfg, deadline)
    return node


def serve_job_store(node: NodeGroup, cfg: LaunchConfig, addr: str) -> None:
    bind = bind_host(addr)
    # a later round on the same launcher: the first round's store keeps the fixed port
    sock = listen(bind, 0 if node.kept else cfg.master_port)
    node.master_addr, node.master_port = addr, sock.getsockname()[1]
    # the server's own client dials it on loopback: the advertised address is for the others
    node.server = serve(sock, bind or "127.0.0.1", CALL_LIMIT)


def register(
    node: NodeGroup,
    cfg: LaunchConfig,
    deadline: float,
    apart: Callable[[], str | None] | None = None,
) -> None:
    """Connect to the job's store and say who this node is; wait until the round is decided.

    Node 0 decides it ready once every node has registered with the same number of nodes;
    any node decides it came apart when the records disagree or `apart()` (the rendezvous,
    asked) says why. The decision is one key set once (compare-and-set), so every node of the
    round reads the same one: no node goes on in a round another has left."""
    prefix = round_prefix(node.round)
    where = f"{node.master_addr}:{node.master_port}"
    host = socket.gethostname()
    store = BoundedStore(node.store_addr, node.master_port, CALL_LIMIT, prefix)
    me = json.dumps(
        {
            "host": host,
            "pid": os.getpid(),
            "rendezvous": serves_rendezvous(node),
            "nnodes": node.nnodes,
        }
    )
    seconds = max(0.0, deadline - time.monotonic())
    failure: list[StoreUnreachableError] = []

    def registered() -> bool:
        try:
            mine = store.key(registration(node.group_rank))
            store.call("set", mine, me, limit=_left(deadline))
            return True
        except StoreUnreachableError as err:
            failure[:] = [err]
            return False

    if not Wait().until(registered, seconds, poll=0.5).done:
        raise LaunchError(
            f"node {node.group_rank} ({host}) cannot reach the job's store at {where} "
            f"within --init-timeout {cfg.init_timeout:g} s: {_cause(failure[-1])}",
            fix=f"check that {host} can reach {where} (address, firewall, interface); "
            "node 0 publishes the address the other nodes reach it by: set it with "
            "--master-addr (or --local-addr) on node 0 if it is not",
        ) from (failure[-1] if failure else None)
    if node.group_rank == 0:
        store.set(RUN_ID, cfg.run_id)
        for other in range(node.nnodes):  # counters exist before anyone reads them
            for kind in keys.COUNTERS:
                store.add(keys.counter(kind, other), 0)
    missing = list(range(node.nnodes))
    records: list[dict[str, object]] = []

    def decide(value: str) -> None:
        with contextlib.suppress(StoreUnreachableError):
            store.call("compare_set", store.key(READY_KEY), "", value)

    def decided() -> bool:
        nonlocal missing, records
        why = apart() if apart is not None else None
        if why is not None:
            decide(f"{APART}{why}")  # unless the round was decided first
        with contextlib.suppress(StoreUnreachableError):
            if store.has(READY_KEY):
                return True
            missing = [n for n in missing if not store.has(registration(n))]
            if missing:
                return False
            records = [json.loads(store.get(registration(n))) for n in range(node.nnodes)]
            differs = next((n for n, r in enumerate(records) if r["nnodes"] != node.nnodes), None)
            if differs is not None:
                decide(
                    f"{APART}node {differs} read a round of {records[differs]['nnodes']} "
                    f"node(s), node {node.group_rank} {node.nnodes}"
                )
            elif node.group_rank == 0:
                decide(READY)
        return False

    if not Wait().until(decided, max(0.0, deadline - time.monotonic()), 0.2).done:
        who = ", ".join(f"node {n}" for n in missing)
        raise LaunchError(
            f"{who or 'node 0'} never reached the job's store at {where} within "
            f"--init-timeout {cfg.init_timeout:g} s",
            fix=f"start `ddpkit run` on every node; check that each can reach {where}",
        )
    decision = store.get(READY_KEY, limit=_left(deadline))
    if decision != READY:
        raise RoundApartError(decision.removeprefix(APART))
    if not records:
        records = [json.loads(store.get(registration(n))) for n in range(node.nnodes)]
    node.rendezvous_node = next((n for n, r in enumerate(records) if r.get("rendezvous")), None)
    node.run_id = store.get(RUN_ID, limit=_left(deadline))
    node.hosts, node.store = [str(r["host"]) for r in records], store


READY, APART = "ready", "apart: "  # the round's decision (READY_KEY)


def serves_rendezvous(node: NodeGroup) -> bool:
    """This machine is the rendezvous endpoint's host (its launcher serves that store)."""
    if not node.rdzv_host:
        return False
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        return bool(_matches_machine_hostname(node.rdzv_host))
    except Exception:
        return False


def resolve(host: str) -> None:
    """A node-0 address that names no machine is a usage error, found before anything waits."""
    try:
        bounded(lambda: socket.getaddrinfo(host, None), CALL_LIMIT, f"looking up {host}")
    except StoreUnreachableError as err:  # unknown (EAI_NONAME), or DNS did not answer
        raise ConfigError(
            f"--master-addr {host!r} does not name a machine ({_cause(err)})",
            fix="give node 0's host name or address as every node resolves it (see /etc/hosts "
            "or DNS), the same on every node",
        ) from None


def check_this_machine(host: str) -> None:
    """One node serves the job's store itself: its --master-addr must be one of its own."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return  # resolve() said it resolves
    for family, _, _, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address[0], 0))
            return
    raise ConfigError(
        f"--master-addr {host!r} is not an address of this machine, and a one-node job serves "
        "its store here",
        fix="leave --master-addr out for a one-node job (ddpkit uses loopback), or give this "
        "machine's address; for several nodes add --nnodes N --node-rank K",
    )


def _left(deadline: float) -> float:
    return max(0.5, deadline - time.monotonic())


def _cause(err: BaseException) -> str:
    cause = err.__cause__ or err
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return text[:200]


def bind_host(addr: str) -> str:
    """Listen on loopback only, unless the job spans machines."""
    return addr if is_loopback(addr) else ""
