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
* a comparison is started at one agreed step and read at the next agreed step, which gives it
  time to finish. A "step" ends at each `optimizer.step()`; in a script without an optimizer,
  every read is a step. Reads between agreed steps return the last agreed value, so every
  read within one step returns the same value on every rank;
* how many steps lie between comparisons is agreed in the comparison itself: each rank
  proposes as many as keep the comparisons' cost (what starting and reading one took) near
  BUDGET of its step time, and the largest proposal wins. On a GPU step of 100 ms that is
  every step; on a 5 ms CPU step, where a gloo collective costs 50-300 us of host time, every
  few dozen. A signal is seen within two comparisons: about 2/BUDGET times one comparison's
  cost (well under a second), and at most 2 x MAX_GAP s at the step time measured at the last
  comparison (steps that slow down after it stretch that in proportion, until the next
  comparison tunes the gap to them).
The first read compares at once.

The rank also tells the launcher (`ddpkit.rank.progress.mark_graceful`) so that, after
forwarding a stop signal, it gives the ranks longer than --grace to save before it kills.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from datetime import timedelta
from typing import Any

from ddpkit.rank import runtime

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
CLOSE_WAIT = 10.0  # seconds close() waits for a comparison still in flight
BUDGET = 0.0005  # the share of the step time the comparisons may take
MAX_GAP = 1.0  # seconds: the most time between two comparisons


class StopFlag:
    def __init__(self) -> None:
        self.requested = False  # this rank got a stop signal (sticky)
        self.signal: int | None = None
        self.installed = False
        self.optimizer_steps = 0  # seen since the first read
        self.reads_alone = 0  # reads before any optimizer step (a script without one)
        self._agreed = False
        self._group: Any = None
        self._hook: Any = None
        self._pending: tuple[Any, Any] | None = None  # (work, [flag, gap] tensor) in flight
        self._due = 0  # the step at which the pending comparison is read (agreed by all)
        # (0 with no group yet: the first read compares at once)
        self._last = (0.0, 0)  # (perf_counter, steps) at the last comparison
        self._cost = 0.0  # seconds the last comparison took this rank (start and wait)
        self._gap = 1  # steps between comparisons, as last agreed

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
        from ddpkit.rank import progress

        progress.mark_graceful()

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True  # only ever set: a comparison in flight cannot undo it
        self.signal = signum

    def _stepped(self, optimizer: Any) -> None:
        if runtime.current().steps.counts(optimizer):  # a second optimizer's step is no step
            self.optimizer_steps += 1

    @property
    def steps(self) -> int:
        """Steps so far: optimizer steps, and before the first one, reads."""
        return self.optimizer_steps + self.reads_alone

    def agreed(self, world_size: int) -> bool:
        """True on every rank, at the same step, once any rank got a stop signal."""
        if self._agreed:
            return True
        if not self.installed:
            self.install()
        if world_size == 1:
            self._agreed = self.requested
            return self._agreed
        if not self.optimizer_steps:
            self.reads_alone += 1  # no optimizer (yet): every read is a step
        if self.optimizer_steps + self.reads_alone < self._due:
            return False  # the hot path: no comparison due at this step
        if self._group is None:  # the first read: compare now
            self._start_watching()
            self._compare(gap=1)
        began = time.perf_counter()
        assert self._pending is not None
        work, result = self._pending
        work.wait()  # started a comparison ago: done by now on every rank but a late one
        self._agreed = bool(result[0])
        self._gap = max(1, int(result[1]))  # the largest proposal: the same on every rank
        self._cost += time.perf_counter() - began  # this comparison's start and wait
        if self._agreed:
            self._pending = None
        else:
            proposal = self._proposal()
            self._cost = 0.0
            self._compare(proposal)
            self._due = self.steps + self._gap
        return self._agreed

    def _proposal(self) -> int:
        """How many steps to the next comparison, by this rank's measure: enough that the
        comparisons cost BUDGET of the time, at most MAX_GAP s apart, and at most twice the
        current gap (so the step time it is measured on spans ever more steps)."""
        now = time.perf_counter()
        then, steps_then = self._last
        self._last = (now, self.steps)
        if not then or self.steps <= steps_then:
            return 1
        step_time = (now - then) / (self.steps - steps_then)
        if step_time <= 0:
            return 1
        by_cost = math.ceil(self._cost / (BUDGET * step_time))
        by_time = int(MAX_GAP / step_time)
        return max(1, min(by_cost, by_time, 2 * self._gap))

    def _start_watching(self) -> None:
        import torch.distributed as dist

        # gloo on CPU tensors: comparing flags never touches a GPU, whatever the job's backend
        self._group = dist.new_group(backend="gloo")
        self._hook = runtime.current().steps.after(self._stepped)

    def _compare(self, gap: int) -> None:
        import torch
        import torch.distributed as dist

        began = time.perf_counter()
        flag = torch.tensor([1 if self.requested else 0, gap], dtype=torch.int64)
        # the untracked all_reduce: this is ddpkit's own, not one of the script's collectives
        all_reduce = getattr(dist.all_reduce, "_ddpkit_original", dist.all_reduce)
        work = all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        self._cost += time.perf_counter() - began

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
