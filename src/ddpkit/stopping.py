"""`s.stop_requested`: stopping on a signal at a step boundary, on every rank at the same step,
without losing a signal and without ever making the host wait for the GPU.

Reading it once says that the script stops on its own: from then on SIGTERM, SIGINT and
SIGUSR1 (from `ddpkit run`, which forwards them, from srun, or from a scheduler's pre-emption)
only set a flag, so the loop can save its state and leave. A script that never reads it keeps
Python's own behaviour.

How every rank agrees, cheaply:
* the signal handler sets this rank's flag, which nothing ever clears (a signal that lands
  while the ranks compare their flags is counted at the next comparison, never dropped);
* the ranks compare flags with an asynchronous MAX all-reduce of a CPU tensor over a small gloo
  group of their own (made at the first read): no GPU, no NCCL, no host-device sync, and the
  job's own collectives and their order are untouched;
* a comparison starts at the first read of a step and is read at the first read of the next
  step, which gives it a whole step to finish (its wait then costs microseconds). A "step"
  ends at each `optimizer.step()`; in a script without an optimizer, every read is a step. So
  every read within one step returns the same value on every rank, and a signal is seen at most
  two steps after it came. The first read compares at once.

The rank also tells the launcher (a state file, `ddpkit.protocol.GRACEFUL`) so that, after
forwarding a stop signal, it gives the ranks longer than --grace to save before it kills.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from typing import Any

from ddpkit import protocol

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
CLOSE_WAIT = 10.0  # seconds close() waits for a comparison still in flight


class StopFlag:
    def __init__(self) -> None:
        self.requested = False  # this rank got a stop signal (sticky)
        self.signal: int | None = None
        self.installed = False
        self.steps = 0  # optimizer steps seen since the first read
        self._agreed = False
        self._group: Any = None
        self._pending: tuple[Any, Any, int] | None = None  # (work, flag tensor, steps at start)
        self._hook: Any = None

    @property
    def local(self) -> bool:
        return self.requested

    def install(self) -> None:
        """Catch the stop signals (main thread only, as Python requires)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        self.installed = True
        state_dir = os.environ.get(protocol.STATE_DIR)
        if state_dir:
            try:
                rank = os.environ.get("RANK", "0")
                protocol.state_path(state_dir, rank, protocol.GRACEFUL).touch()
            except OSError:
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True  # only ever set: a comparison in flight cannot undo it
        self.signal = signum

    def _stepped(self, *_: Any) -> None:
        self.steps += 1

    def agreed(self, world_size: int) -> bool:
        """True on every rank, at the same step, once any rank got a stop signal."""
        self.install()
        if self._agreed:
            return True
        if world_size == 1:
            self._agreed = self.requested
            return self._agreed
        if self._group is None:
            self._start_watching()
        pending = self._pending
        if pending is not None and pending[2] == self.steps and self.steps:
            return False  # this step's comparison is still the current one
        if pending is None:
            pending = self._compare()  # the first read: compare now
        work, flag, _ = pending
        work.wait()  # started a step ago: done by now on every rank but a late one
        self._agreed = bool(flag[0])
        self._pending = None if self._agreed else self._compare()
        return self._agreed

    def _start_watching(self) -> None:
        import torch.distributed as dist
        import torch.optim.optimizer as optimizer

        # gloo on CPU tensors: comparing flags never touches a GPU, whatever the job's backend
        self._group = dist.new_group(backend="gloo")
        self._hook = optimizer.register_optimizer_step_post_hook(self._stepped)

    def _compare(self) -> tuple[Any, Any, int]:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        # the untracked all_reduce: this is ddpkit's own, not one of the script's collectives
        all_reduce = getattr(dist.all_reduce, "_ddpkit_original", dist.all_reduce)
        work = all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return work, flag, self.steps

    def close(self, failed: bool = False) -> None:
        """Before the job's group goes: let the last comparison finish (every rank started it),
        unless the job failed and peers may never take part in it."""
        pending, self._pending = self._pending, None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if pending is not None and not failed:
            try:
                pending[0].wait(timedelta(seconds=CLOSE_WAIT))
            except Exception:  # a peer that is gone: nothing left to agree on
                pass
