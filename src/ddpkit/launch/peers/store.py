"""Store calls that cannot hang the launcher.

torch's TCPStore client has a timeout for `get`/`wait`, but nothing bounds a call whose peer is
unreachable: with a link cut, `add` blocked for as long as the cut lasted (40 s here, measured
across two network namespaces), and a launcher stuck there ignores Ctrl+C. Every call here
runs on a thread of its own and the caller waits at most `limit` seconds; a call that does not
return in time raises `StoreUnreachableError`, and the client is dropped (its thread may stay
blocked in the kernel; it is a daemon and holds nothing else). The next call connects afresh.

`serve` starts a TCPStore server on a socket the launcher already holds (no race for the
port; ddpkit.common.store_server, shared with rank 0, which serves a one-node job's store);
`connect` makes a client. Nothing here imports torch until a store is made.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar, cast

from ddpkit.common.store_server import serve_fd

if TYPE_CHECKING:  # the launcher imports torch only when it serves or dials a store
    from torch._C._distributed_c10d import TCPStore

T = TypeVar("T")

StoreArg = str | bytes | int | list[str]  # what a TCPStore call takes


class StoreUnreachableError(Exception):
    """A store call did not answer within its bound, or the store refused the connection."""


def bounded(fn: Callable[[], T], limit: float, what: str) -> T:
    """`fn()` on a daemon thread, given at most `limit` s (StoreUnreachableError beyond)."""
    values: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            values.append(fn())
        except BaseException as err:  # handed to the caller
            errors.append(err)

    thread = threading.Thread(target=target, daemon=True, name=f"ddpkit-store-{what}")
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise StoreUnreachableError(f"{what} did not answer within {limit:g} s")
    if errors:
        err = errors[0]
        raise StoreUnreachableError(f"{what} failed: {type(err).__name__}: {err}") from err
    return values[0]


class BoundedStore:
    """A client of the TCPStore at addr:port whose every call returns within `limit` seconds.
    One instance per thread that uses it (calls are not interleaved on one connection)."""

    def __init__(self, addr: str, port: int, limit: float, prefix: str = "") -> None:
        self.addr, self.port, self.limit, self.prefix = addr, port, limit, prefix
        self._client: TCPStore | None = None
        # whether the latest call failed: a launcher in a hurry does not try again
        self.unreachable = False

    @property
    def where(self) -> str:
        return f"{self.addr}:{self.port}"

    def _connected(self) -> TCPStore:
        if self._client is None:
            self._client = connect(self.addr, self.port, self.limit)
        return self._client

    def call(self, method: str, *args: StoreArg, limit: float | None = None) -> object:
        """TCPStore's `method` (set, get, add, check, multi_get) with `args`, bounded; what it
        returned (the typed wrappers below say what that is)."""
        bound = self.limit if limit is None else limit

        def go() -> object:
            return cast(object, getattr(self._connected(), method)(*args))

        try:
            value = bounded(go, bound, f"{method} on the store at {self.where}")
        except StoreUnreachableError:
            self._client = None  # never reuse a connection that may be stuck mid-call
            self.unreachable = True
            raise
        self.unreachable = False
        return value

    def key(self, name: str) -> str:
        return self.prefix + name

    def set(self, name: str, value: str) -> None:
        self.call("set", self.key(name), value)

    def get(self, name: str, limit: float | None = None) -> str:
        return cast(bytes, self.call("get", self.key(name), limit=limit)).decode()

    def add(self, name: str, amount: int) -> int:
        return int(cast(int, self.call("add", self.key(name), amount)))

    def has(self, name: str) -> bool:
        return bool(self.call("check", [self.key(name)]))

    def counters(self, names: list[str]) -> list[int]:
        """Several counters in one round trip where this torch has multi_get."""
        keys = [self.key(n) for n in names]
        try:
            values = cast(list[bytes], self.call("multi_get", keys))
        except StoreUnreachableError as err:
            if not isinstance(err.__cause__, AttributeError):
                raise
            return [self.add(n, 0) for n in names]
        return [int(bytes(v).decode() or 0) for v in values]

    def close(self) -> None:
        self._client = None


def connect(addr: str, port: int, timeout: float) -> TCPStore:
    """A TCPStore client (waits up to `timeout` for the server to accept)."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout))  # type: ignore[attr-defined]


def serve(sock: socket.socket, addr: str, timeout: float) -> TCPStore:
    """A TCPStore server on the listening socket the launcher holds; the socket is handed over."""
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return serve_fd(fd, addr, port, timeout)
    finally:
        os.close(fd)
