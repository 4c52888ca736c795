"""How the launchers of a job's nodes find each other and notice when one is gone.

One node: nothing to do. Several nodes meet either through torch elastic's c10d rendezvous
(`--rdzv HOST:PORT`, the existing engine) or statically (`--node-rank K --master-addr HOST
--master-port P`, also what `srun ddpkit run` uses). Node 0 then publishes where its workers'
store listens. Each launcher beats a counter in a shared store every 0.5 s; a node whose counter
stops for PEER_TIMEOUT s, a store that stops answering, or an abort key set by a failing node
makes every other node tear its workers down.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ddpkit.errors import LaunchError
from ddpkit.launch.config import LaunchConfig

PEER_TIMEOUT = 3.0
BEAT_EVERY = 0.5
EXIT_BARRIER = 300.0  # as torchrun's agents wait for each other at the end


@dataclass
class NodeGroup:
    """This node's place among the job's nodes. Store calls go through one lock: the
    heartbeat thread and the main thread share the connection."""

    group_rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    run_id: str = ""
    control: Any = None  # a torch Store shared by the launchers (None on one node)
    lost: str | None = None  # why another node is gone, set by the heartbeat thread
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def hosts_store(self) -> bool:
        return self.group_rank == 0

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self.control, method)(*args)

    def publish(self, key: str, value: str) -> None:
        if self.control is not None:
            self._call("set", f"ddpkit/{key}", value)

    def fetch(self, key: str) -> str:
        return str(self._call("get", f"ddpkit/{key}").decode())

    def has(self, key: str) -> bool:
        return bool(self._call("check", [f"ddpkit/{key}"]))

    def share_run_id(self, own: str) -> None:
        """Every node takes node 0's run id, so the job has one name on every machine."""
        if self.hosts_store:
            self.run_id = own
            self.publish("run_id", own)
        else:
            self.run_id = self.fetch("run_id")

    def start_heartbeat(self) -> None:
        if self.control is not None:
            threading.Thread(target=self._beat, daemon=True, name="ddpkit-heartbeat").start()

    def abort(self, reason: str) -> None:
        """Tell the other nodes this node failed (best effort)."""
        if self.control is not None:
            try:
                self.publish("abort", f"node {self.group_rank}: {reason}")
            except Exception:
                pass

    def finish(self, timeout: float = EXIT_BARRIER) -> None:
        """After this node's workers succeeded: wait (bounded) until every node is done, so
        the node that hosts the store does not take it away from the others."""
        if self.control is None:
            return
        try:
            self.publish(f"done/{self.group_rank}", "1")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not self.lost:
                if all(self.has(f"done/{n}") for n in range(self.nnodes)):
                    return
                time.sleep(0.2)
        except Exception:
            return

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(BEAT_EVERY):
            try:
                self._call("add", f"ddpkit/beat/{self.group_rank}", 1)
                if self.has("abort"):
                    self.lost = self.fetch("abort")
                    return
                now = time.monotonic()
                for node in range(self.nnodes):
                    if node == self.group_rank or self.has(f"done/{node}"):
                        continue
                    count = self._call("add", f"ddpkit/beat/{node}", 0)
                    last = seen.get(node)
                    if last is None or count != last[0]:
                        seen[node] = (count, now)
                    elif now - last[1] > PEER_TIMEOUT:
                        self.lost = f"node {node}'s launcher stopped answering"
                        return
            except Exception as err:
                if not self._stop.is_set():
                    self.lost = f"lost contact with the job's store ({type(err).__name__})"
                return


def join(cfg: LaunchConfig) -> NodeGroup:
    """Meet the other nodes (if any) and learn this node's rank and rank 0's address."""
    if not cfg.multi_node:
        return NodeGroup(master_addr=cfg.master_addr, run_id=cfg.run_id)
    if cfg.rdzv:
        return _join_rdzv(cfg)
    return _join_static(cfg)


def _join_rdzv(cfg: LaunchConfig) -> NodeGroup:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    assert cfg.rdzv is not None  # noqa: S101 - checked by the caller
    params = RendezvousParameters(
        backend="c10d",
        endpoint=cfg.rdzv,
        run_id=cfg.run_id if cfg.run_id_given else "ddpkit",
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        join_timeout=str(int(cfg.init_timeout)),
    )
    try:
        handler = get_rendezvous_handler(params)
        info = handler.next_rendezvous()
    except Exception as err:
        raise LaunchError(
            f"the {cfg.nnodes} nodes did not meet at {cfg.rdzv} within "
            f"{cfg.init_timeout:.0f} s ({type(err).__name__}: {err})",
            fix="start `ddpkit run` with the same --nnodes and --rdzv on every node, and "
            "check that HOST:PORT is reachable from each",
        ) from err
    store, rank, world = (
        (info.store, info.rank, info.world_size) if hasattr(info, "store") else info
    )
    group = NodeGroup(group_rank=rank, nnodes=world, control=store)
    host = cfg.rdzv.rpartition(":")[0]
    if rank == 0:
        group.master_addr = cfg.master_addr if cfg.master_addr_given else _address_for(host)
    group.share_run_id(cfg.run_id)
    return group


def _join_static(cfg: LaunchConfig) -> NodeGroup:
    import torch.distributed as dist

    from ddpkit.launch.ports import listen

    rank = cfg.node_rank or 0
    port = cfg.master_port + 1  # the launchers' own store, beside the workers'
    timeout = timedelta(seconds=cfg.init_timeout)
    try:
        if rank == 0:
            sock = listen(bind_host(cfg.master_addr), port)
            store = dist.TCPStore(
                cfg.master_addr,
                port,
                None,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
        else:
            store = dist.TCPStore(cfg.master_addr, port, None, False, timeout)
    except (RuntimeError, dist.DistNetworkError) as err:
        raise LaunchError(
            f"node {rank} could not reach node 0's launcher at {cfg.master_addr}:{port} "
            f"within {cfg.init_timeout:.0f} s",
            fix="start node 0 too, with the same --master-addr/--master-port on every node",
        ) from err
    group = NodeGroup(
        group_rank=rank, nnodes=cfg.nnodes, master_addr=cfg.master_addr, control=store
    )
    group.share_run_id(cfg.run_id)
    return group


def _address_for(host: str) -> str:
    """Where workers on other nodes reach node 0: the rendezvous host when it is this
    machine, else this machine's name."""
    if _is_loopback(host) or host in _local_addresses():
        return host
    return socket.getfqdn()


def bind_host(addr: str) -> str:
    """Listen on loopback only, unless the job spans machines."""
    return addr if _is_loopback(addr) else ""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _local_addresses() -> set[str]:
    try:
        import psutil

        return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:
        return set()
