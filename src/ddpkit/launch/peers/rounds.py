"""How a launcher meets the job's other nodes: `join`, the one way in (one node: a held port;
static nodes: `ddpkit.launch.peers.nodes`), and torch elastic's c10d rendezvous, round after
round (`--rdzv HOST:PORT`, the engine torchrun uses; node ranks come from it).

Each round: torch's handler says this node's rank and the number of nodes; node 0 serves the
job's store and publishes where in the round's rendezvous store; every node registers
(`ddpkit.launch.peers.nodes.register`). A round can come apart while the nodes meet: torch
drops a participant whose keep-alive lapsed (a loaded machine, a paused launcher) from the
state the other nodes then read, so one node may read a world the others do not. Each node
checks the round it read, that every node read the same size, and, while it waits, that its
round is still the rendezvous's; a round that came apart is met again, until --init-timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from ddpkit.common.network import address_toward
from ddpkit.errors import LaunchError
from ddpkit.launch.base.config import LaunchConfig
from ddpkit.launch.base.output import CONSOLE
from ddpkit.launch.base.ports import listen
from ddpkit.launch.base.wait import Wait
from ddpkit.launch.peers.nodes import (
    CALL_LIMIT,
    NodeGroup,
    RoundApartError,
    bind_host,
    check_this_machine,
    join_static,
    register,
    resolve,
    serve_job_store,
)
from ddpkit.launch.peers.store import StoreUnreachableError, bounded

if TYPE_CHECKING:  # torch is imported only when a rendezvous is made
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler

log = logging.getLogger(__name__)


def join(cfg: LaunchConfig) -> NodeGroup:
    """Meet the other nodes (if any): this node's rank, the job's store, every node's host."""
    if cfg.master_addr_given:
        resolve(cfg.master_addr)
    if not cfg.multi_node:
        if cfg.master_addr_given:
            check_this_machine(cfg.master_addr)
        held = listen(bind_host(cfg.master_addr), cfg.master_port)
        return NodeGroup(
            master_addr=cfg.master_addr,
            master_port=held.getsockname()[1],
            run_id=cfg.run_id,
            held=held,
            hosts=[socket.gethostname()],
        )
    if cfg.rdzv:
        return join_rdzv(cfg, rendezvous=None)
    return join_static(cfg)


def check_round(rank: int, world: int, min_nodes: int) -> str | None:
    """Why a round torch handed out cannot be this node's, or None if it can."""
    if not 0 <= rank < world:
        return f"this node read rank {rank} in a round of {world} node(s)"
    if world < min_nodes:
        return f"this node read a round of {world} node(s), fewer than --nnodes MIN {min_nodes}"
    return None


def join_rdzv(
    cfg: LaunchConfig,
    rendezvous: RendezvousHandler | None,
    kept: list[TCPStore] | None = None,
) -> NodeGroup:
    """A round of torch elastic's c10d rendezvous; node 0 then serves the job's store and
    publishes where, in the rendezvous store, as torch elastic's bootstrap store info does.

    A round can come apart while the nodes meet: torch drops a participant whose keep-alive
    lapsed (a loaded machine, a paused launcher) from the state that other nodes then read, so
    one node may read a world the others do not (its own rank outside it, a world smaller than
    MIN, or a different size). Each node checks that, and that every node read the same size;
    a round that came apart is met again, until --init-timeout."""
    assert cfg.rdzv is not None
    if rendezvous is None:
        rendezvous = _rendezvous_handler(cfg)
    kept = [] if kept is None else kept
    deadline = time.monotonic() + cfg.init_timeout
    while True:
        try:
            return _join_round(cfg, rendezvous, kept, deadline)
        except RoundApartError as apart:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"the nodes met at {cfg.rdzv} but did not agree on one round within "
                    f"--init-timeout {cfg.init_timeout:g} s: {apart}",
                    fix="a node's launcher stalled longer than the rendezvous keep-alive "
                    "(keep_alive_interval x keep_alive_max_attempt in --rdzv-conf): raise "
                    "them, or give the nodes' launchers a core",
                ) from None
            CONSOLE.say(f"ddpkit: the nodes meet again: {apart}")
            log.info("round came apart: %s", apart)


def _join_round(
    cfg: LaunchConfig, rendezvous: RendezvousHandler, kept: list[TCPStore], deadline: float
) -> NodeGroup:
    assert cfg.rdzv is not None
    _spare_torchs_bootstrap_wait(rendezvous)
    try:
        info = rendezvous.next_rendezvous()
    except Exception as err:
        raise LaunchError(
            f"the {cfg.nnodes} nodes did not meet at {cfg.rdzv} within "
            f"{cfg.init_timeout:.0f} s ({type(err).__name__}: {err})",
            fix="start `ddpkit run` with the same --nnodes and --rdzv on every node, and "
            "check that HOST:PORT is reachable from each",
        ) from err
    # torch < 2.3 returns (store, rank, world size); later a RendezvousInfo
    rdzv_store, rank, world = (
        (info.store, info.rank, info.world_size) if hasattr(info, "store") else info  # type: ignore[misc]
    )
    round_ = _round_of(rendezvous)
    wrong = check_round(rank, world, cfg.min_nodes)
    if wrong is not None:
        raise RoundApartError(wrong)
    key = "ddpkit/job"  # the rendezvous store torch hands out is already this round's
    rdzv_host = cfg.rdzv.rpartition(":")[0]
    node = NodeGroup(
        group_rank=rank,
        nnodes=world,
        round=round_,
        rendezvous=rendezvous,
        rdzv_host=rdzv_host,
        kept=kept,
    )
    apart = _Apart(rendezvous, round_)
    try:
        if rank == 0:
            addr = (
                cfg.master_addr
                if cfg.master_addr_given
                else cfg.local_addr or address_toward(rdzv_host)
            )
            serve_job_store(node, cfg, addr)
            record = json.dumps({"addr": addr, "port": node.master_port, "run_id": cfg.run_id})
            bounded(lambda: rdzv_store.set(key, record), CALL_LIMIT, "publishing the store")
            node.run_id = cfg.run_id
        else:
            where = _read_where_node_0_is(rdzv_store, key, rank, cfg, deadline, apart)
            node.master_addr, node.master_port = where["addr"], int(where["port"])
            node.run_id = where["run_id"]
        register(node, cfg, deadline, apart.check)
    except RoundApartError:
        if node.server is not None:  # a node may still be talking to it: kept to the end
            kept.append(node.server)
            node.server = None
        if node.store is not None:
            node.store.close()
        raise
    return node


def _read_where_node_0_is(
    rdzv_store: object, key: str, rank: int, cfg: LaunchConfig, deadline: float, apart: _Apart
) -> dict[str, str]:
    def published() -> bool:
        why = apart.check()  # this node has not registered: no one can have gone on in it
        if why is not None:
            raise RoundApartError(why)
        return bool(bounded(lambda: rdzv_store.check([key]), CALL_LIMIT, "asking the rendezvous"))  # type: ignore[attr-defined]

    try:
        if not Wait().until(published, max(1.0, deadline - time.monotonic()), poll=0.2).done:
            raise StoreUnreachableError(f"nothing published within {cfg.init_timeout:g} s")
        raw = bounded(lambda: rdzv_store.get(key), CALL_LIMIT, "reading where node 0 is")  # type: ignore[attr-defined]
    except StoreUnreachableError as err:
        raise LaunchError(
            f"node {rank} met the others at {cfg.rdzv} but node 0 never said where the "
            f"job's store is ({err})",
            fix="check that node 0's launcher is running and reachable",
        ) from err
    record: dict[str, str] = json.loads(bytes(raw).decode())
    return record


def _spare_torchs_bootstrap_wait(rendezvous: RendezvousHandler) -> None:
    """torch's next_rendezvous ends by reading MASTER_ADDR/MASTER_PORT, which the node it
    made rank 0 writes (its bootstrap store info; ddpkit does not use it: node 0 publishes the
    job's store itself). In a round that came apart that node may never finish the round, and
    the others would wait there for the rendezvous store's read_timeout (60 s) before ddpkit
    could see why. Written first, for this round and the next two, that read has nothing to
    wait for; the real rank 0 overwrites them. Best effort: torch's internals where present."""
    store = getattr(rendezvous, "_store", None)
    run_id = getattr(getattr(rendezvous, "_settings", None), "run_id", None)
    if store is None or run_id is None:
        return
    from torch._C._distributed_c10d import PrefixStore

    def write() -> None:
        rendezvous.num_nodes_waiting()  # syncs the handler's state: the round is current
        first = _round_of(rendezvous)
        for round_ in range(first, first + 3):
            prefixed = PrefixStore(f"torch.rendezvous.{run_id}.{round_}", store)
            for key, value in (("MASTER_ADDR", "unused-by-ddpkit"), ("MASTER_PORT", "0")):
                prefixed.compare_set(key, "", value)  # only where no one wrote it

    with contextlib.suppress(Exception):
        bounded(write, CALL_LIMIT, "preparing the rendezvous round")


class _Apart:
    """Asks the rendezvous, at most once a second, whether this node's round is still the one
    the rendezvous holds (torch keeps that in its handler's state: read where present)."""

    def __init__(self, rendezvous: RendezvousHandler | None, round_: int) -> None:
        self.rendezvous, self.round, self.asked = rendezvous, round_, 0.0

    def check(self) -> str | None:
        """Why this node's round is no longer the rendezvous's, or None (also when it cannot
        tell now: the deadline decides)."""
        if self.rendezvous is None or time.monotonic() - self.asked < 1.0:
            return None
        self.asked = time.monotonic()
        handler = self.rendezvous
        try:
            waiting = int(bounded(handler.num_nodes_waiting, CALL_LIMIT, "asking the rendezvous"))
        except Exception:
            return None
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        me = getattr(handler, "_this_node", None)
        if state is not None and int(getattr(state, "round", self.round)) != self.round:
            return f"the rendezvous moved on to round {state.round}"
        participants = getattr(state, "participants", None)
        if me is not None and participants is not None and me not in participants:
            return "the rendezvous dropped this node from the round"
        if waiting:
            return f"{waiting} node(s) wait for a new round"
        return None


def _round_of(rendezvous: RendezvousHandler) -> int:
    """The rendezvous round (the same number on every node of it), where torch tells it."""
    state = getattr(getattr(rendezvous, "_state_holder", None), "state", None)
    return int(getattr(state, "round", 0))


def _rendezvous_handler(cfg: LaunchConfig) -> RendezvousHandler:
    # torch >= 2.5 also serves a second store from node 0 unless told not to; ddpkit has its own
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    assert cfg.rdzv is not None
    settings = {"join_timeout": str(int(cfg.init_timeout)), **dict(cfg.rdzv_conf)}
    params = RendezvousParameters(
        backend="c10d",
        endpoint=cfg.rdzv,
        run_id=cfg.run_id if cfg.run_id_given else "ddpkit",
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.nnodes,
        local_addr=cfg.local_addr,
        **settings,
    )
    try:
        return get_rendezvous_handler(params)
    except Exception as err:
        raise LaunchError(
            f"could not reach the rendezvous at {cfg.rdzv} ({type(err).__name__}: {err})",
            fix="check HOST:PORT: the same on every node, reachable from each; the node "
            "whose address it is serves it",
        ) from err
