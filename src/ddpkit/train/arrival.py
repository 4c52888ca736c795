"""The wait at `setup()` for every peer: bounded by the stated timeout, said within a second,
and ended by Ctrl+C at once.

torch's TCPStore waits inside C++: a client retries its connect until its own timeout (and then
some: 8 s asked, 23 s measured), and neither side lets Ctrl+C through while it waits (the signal
interrupts a system call, which C++ retries). So the waiting here is Python's: a plain socket
probe until rank 0 listens, then the store's non-blocking `check` polled with a sleep, each
step bounded by one deadline. Ctrl+C lands between two steps (at most a quarter second late) as
`InitInterrupted`: ddpkit's words, no traceback, the exit of a KeyboardInterrupt.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ddpkit.common.ranges import ranks_text
from ddpkit.env import DistEnv
from ddpkit.errors import InitInterrupted, InitTimeoutError

SAY_AFTER_S = 1.0  # a wait this long is said (the bound: within 2 s)
POLL_S = (0.02, 0.25)  # the first and the longest sleep between two looks


class Wait:
    """One deadline for the whole wait, and the line that says what it waits for."""

    def __init__(self, env: DistEnv, timeout: float, is_server: bool) -> None:
        self.env = env
        self.timeout = timeout
        self.is_server = is_server
        self.began = time.monotonic()
        self.deadline = self.began + timeout
        self.said = env.launcher == "ddpkit"  # ddpkit run's own init watch names who is late
        self.pause = POLL_S[0]
        self.waiting_for = "the other ranks"
        self.connected = False  # a client that reached the store, waiting for the others

    @property
    def where(self) -> str:
        return f"{self.env.master_addr}:{self.env.master_port}"

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def waited(self) -> float:
        return time.monotonic() - self.began

    def about_to_say(self) -> bool:
        return not self.said and self.waited() >= SAY_AFTER_S

    def sleep(self) -> None:
        """Sleep a little longer each time (the store is asked at most 4 times a second by
        each rank), never past the deadline; say the wait once it is long."""
        if not self.said and self.waited() >= SAY_AFTER_S:
            self.said = True
            print(f"ddpkit: {self.line()}", file=sys.stderr, flush=True)
        time.sleep(min(self.pause, self.left()))
        self.pause = min(POLL_S[1], self.pause * 2)

    def line(self) -> str:
        env = self.env
        me = f"rank {env.rank} of {env.world_size}"
        how = {
            "env": " (RANK and WORLD_SIZE set by hand: every rank must be started)",
            "none": "",
        }.get(env.launcher, "")
        if self.is_server:
            what = f"{me} listens on {self.where} and waits for {self.waiting_for}"
        elif self.connected:
            what = f"{me} waits at {self.where} for {self.waiting_for}"
        else:
            what = f"{me} waits for rank 0 to listen at {self.where}"
        return (
            f"{what}{how}; it waits up to {self.timeout:.0f} s (DDPKIT_INIT_TIMEOUT or "
            "setup(timeout=...)); Ctrl+C stops it"
        )


def rendezvous(env: DistEnv, init_timeout: float) -> dist.Store:
    """A store every rank shares, after every rank has arrived (or an error naming who did
    not, within init_timeout; or InitInterrupted on Ctrl+C)."""
    if env.world_size == 1 and env.launcher == "none":
        return dist.HashStore()
    from ddpkit.rank import progress

    progress.set_phase("init")  # the launcher's init watch starts now: it names who never arrives
    # Under ddpkit run / torchrun the launcher holds the store; otherwise rank 0 does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    wait = Wait(env, init_timeout, is_server=env.rank == 0 and not agent_store)
    try:
        store = _connect(wait)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _arrive(store, f"ddpkit/arrive/{attempt}/", wait)
    except KeyboardInterrupt:
        raise InitInterrupted(
            f"interrupted at setup() after {wait.waited():.0f} s: {wait.line().split(';')[0]}",
            fix="start every rank at once with a launcher: `ddpkit run -n "
            f"{env.world_size} script.py` (or unset RANK and WORLD_SIZE to run one process)",
        ) from None
    return dist.PrefixStore(f"ddpkit/pg/{attempt}", store)


def _connect(wait: Wait) -> dist.TCPStore:
    env = wait.env
    if not wait.is_server:
        _until_listening(wait)
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            wait.is_server,
            timeout=timedelta(seconds=max(1.0, wait.left())),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, dist.DistNetworkError) as err:
        if wait.is_server:
            from ddpkit.common.procs import port_taken_fix

            raise InitTimeoutError(
                f"rank 0 could not listen on {wait.where}: {_first_line(err)}",
                fix=port_taken_fix(env.master_port, "the"),
            ) from None
        raise _unreachable(wait) from None
    # the store's later calls (init_process_group's own) get the whole init timeout, as they
    # did when torch's connect waited: the time spent waiting for rank 0 is not theirs to lose
    store.set_timeout(timedelta(seconds=wait.timeout))
    return store


def _until_listening(wait: Wait) -> None:
    """Return once something listens at MASTER_ADDR:MASTER_PORT; InitTimeoutError when nothing
    did by the deadline."""
    env = wait.env
    while True:
        try:
            with socket.create_connection(
                (env.master_addr, env.master_port), timeout=max(0.05, min(1.0, wait.left()))
            ):
                return
        except OSError:
            pass
        if wait.left() <= 0:
            raise _unreachable(wait)
        wait.sleep()


def _arrive(store: dist.Store, prefix: str, wait: Wait) -> None:
    env = wait.env
    store.set(f"{prefix}{env.rank}", "1")
    if store.add(f"{prefix}count", 1) == env.world_size:
        store.set(f"{prefix}all", "1")  # the last to arrive tells the others
    while not store.check([f"{prefix}all"]):  # type: ignore[attr-defined]  # torch 2.4 stubs lack it
        if wait.left() <= 0:
            missing = [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]  # type: ignore[attr-defined]
            arrived = env.world_size - len(missing)
            raise InitTimeoutError(
                f"{arrived} of {env.world_size} ranks arrived at init within "
                f"{wait.timeout:.0f} s; missing: rank {ranks_text(missing)}",
                fix="start every rank with the same WORLD_SIZE (ddpkit run does), or look at "
                "why the missing ranks stopped before setup()",
            )
        wait.connected = True
        if wait.about_to_say():  # who is missing, asked once: for the line alone
            missing = _missing(store, prefix, env.world_size)
            if missing:
                wait.waiting_for = f"rank {ranks_text(missing)}"
        wait.sleep()


def _missing(store: dist.Store, prefix: str, world_size: int) -> list[int]:
    if world_size > 64:  # one look per rank: too many to name
        return []
    return [r for r in range(world_size) if not store.check([f"{prefix}{r}"])]  # type: ignore[attr-defined]


def _unreachable(wait: Wait) -> InitTimeoutError:
    return InitTimeoutError(
        f"rank {wait.env.rank} could not reach rank 0 at {wait.where} within {wait.timeout:.0f} s",
        fix="start every rank (ddpkit run does), and check MASTER_ADDR/MASTER_PORT",
    )


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
