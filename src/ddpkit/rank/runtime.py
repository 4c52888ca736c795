"""This process's runtime as a rank: what the launcher's environment says about it, read once,
and the one optimizer-step hub that everything following the script's steps subscribes to
(the step timing, the job's step count, the rescue, the stop flag).

The bootstrap builds it (`start`) once it has marked the rank's own process; a process that
`ddpkit run` did not start builds it at first use. A DataLoader worker or any child forked
from the rank inherits the launcher's variables and this object, and `is_rank()` tells it
apart: it is not the rank, and writes none of the rank's files. `reset()` gives the process a
fresh runtime with no subscriber left (what tests use between cases).

The hub registers torch's global optimizer hooks once, when the first part subscribes, and
decides once which optimizer's steps are the job's steps: the first one that steps (a GAN's
second optimizer, or a scheduler's, does not count twice).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ddpkit.common import protocol

Subscriber = Callable[[Any], None]  # called with the optimizer that steps
Part = TypeVar("Part")


@dataclass
class Subscription:
    hub: StepHub
    fn: Subscriber
    before: bool

    def remove(self) -> None:
        self.hub.remove(self)


@dataclass
class StepHub:
    _before: list[Subscription] = field(default_factory=list)
    _after: list[Subscription] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)  # torch's hook handles, once registered
    counting: int | None = None  # id() of the optimizer whose steps are the job's steps

    def before(self, fn: Subscriber) -> Subscription:
        """Call `fn(optimizer)` as every optimizer.step() begins."""
        return self._add(Subscription(self, fn, before=True))

    def after(self, fn: Subscriber) -> Subscription:
        """Call `fn(optimizer)` as every optimizer.step() ends."""
        return self._add(Subscription(self, fn, before=False))

    def counts(self, optimizer: Any) -> bool:
        """Whether this optimizer's steps are the job's steps: the first one that stepped."""
        return self.counting == id(optimizer)

    def remove(self, sub: Subscription) -> None:
        for subs in (self._before, self._after):
            if sub in subs:
                subs.remove(sub)

    def close(self) -> None:
        """Every subscriber gone and torch's hooks taken out."""
        self._before.clear()
        self._after.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.counting = None

    def _add(self, sub: Subscription) -> Subscription:
        if not self._handles:
            import torch.optim.optimizer as optimizer_module

            self._handles.append(optimizer_module.register_optimizer_step_pre_hook(self._began))
            self._handles.append(optimizer_module.register_optimizer_step_post_hook(self._ended))
        (self._before if sub.before else self._after).append(sub)
        return sub

    def _began(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for sub in list(self._before):
            sub.fn(optimizer)

    def _ended(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.counting is None:
            self.counting = id(optimizer)
        for sub in list(self._after):
            sub.fn(optimizer)


@dataclass
class Runtime:
    state_dir: str  # the job's state folder; "" outside ddpkit run
    rank: str | None
    rank_pid: str | None  # the pid the bootstrap marked as the rank's own process
    steps: StepHub = field(default_factory=StepHub)
    _parts: dict[type, Any] = field(default_factory=dict)

    def part(self, kind: type[Part]) -> Part:
        """This rank's state of one concern (the step count, the rescue, the step timing...),
        made at first use: every module keeps its state here, none in globals of its own."""
        found = self._parts.get(kind)
        if found is None:
            found = self._parts[kind] = kind()
        return found  # type: ignore[no-any-return]

    def close(self) -> None:
        """The hub's subscribers and torch's hooks gone; each part's `close()`, if it has one."""
        self.steps.close()
        for found in self._parts.values():
            close = getattr(found, "close", None)
            if callable(close):
                close()

    @property
    def launched(self) -> bool:
        """Started by ddpkit run (this process, or the rank it was forked from)."""
        return bool(self.state_dir) and self.rank is not None

    def is_rank(self) -> bool:
        """This process is the rank ddpkit run started, not a child of it."""
        return self.launched and self.rank_pid == str(os.getpid())

    @property
    def rank_name(self) -> str:
        """The rank as its files name it ("0" for a process of its own)."""
        return self.rank or "0"

    def path(self, name: str) -> Path:
        """One of this rank's files in the state folder."""
        return protocol.state_path(self.state_dir, self.rank_name, name)


def _from_environment() -> Runtime:
    env = os.environ
    return Runtime(env.get(protocol.STATE_DIR, ""), env.get("RANK"), env.get(protocol.RANK_PID))


_runtime: Runtime | None = None


def current() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _from_environment()
    return _runtime


def start() -> Runtime:
    """The bootstrap: the environment read, once the rank's process is marked."""
    global _runtime
    before = _runtime
    _runtime = _from_environment()
    if before is not None:  # what was subscribed or kept before stays
        _runtime.steps, _runtime._parts = before.steps, before._parts
    return _runtime


def reset() -> Runtime:
    """A fresh runtime from the environment as it is now, with no subscriber left."""
    global _runtime
    if _runtime is not None:
        _runtime.close()
    _runtime = _from_environment()
    return _runtime
