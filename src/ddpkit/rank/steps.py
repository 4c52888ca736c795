"""Every step of this rank timed, with no change to the script, into its step record
(`ddpkit.common.protocol.StepWriter`), for the launcher's speed doctor.

A step ends at each `optimizer.step()` (torch's global optimizer hooks: plain loops, `s.wrap`,
Lightning, Hugging Face's Trainer and Accelerate all call it; the first optimizer that steps
marks the steps when there are several). Each step is split into:

* data: time blocked in a DataLoader's `__next__` (the next batch);
* comm: time waiting for communication: blocked in a torch.distributed collective, plus what
  DDP's overlap did not hide (from the moment the last gradient of a backward is computed to
  the end of that backward, where DDP waits for its all-reduces); on a GPU that wait is timed
  on the GPU (CUDA events), as NCCL's kernels run there;
* compute: the rank's own work. On the CPU, the rest of the step; on a GPU, the GPU time of
  the step (from the end of the previous step to the end of this one, in stream order) less
  that communication wait;
* host: on a GPU, the step's wall time the GPU was not busy with it and the host was not
  waiting for data (a host that cannot launch kernels fast enough); on the CPU, ddpkit's own
  time inside the DataLoader (s.loader's seeding), so it never counts as the user's data.

The last gradient of a backward is found once: at the first timed step every parameter of the
optimizer reports when its gradient is accumulated, then only the last one keeps its hook. GPU
timings are read a few steps late, when their events have completed, so the rank never waits.
Cost per step: a few Python calls and three CUDA events (benchmarks/step_timing_cost.py).
Outside a worker of `ddpkit run`, or with DDPKIT_STEP_TIMING=0, nothing is installed.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import profiling, runtime

OFF_VARIABLE = "DDPKIT_STEP_TIMING"  # 0: no step timing in the ranks


def _beat() -> None:
    """A step is progress for the hang watch (ddpkit.rank.progress)."""
    from ddpkit.rank.progress import beat

    beat()


MAX_BACKWARDS = 16  # backward passes timed per step (gradient accumulation)
# The launcher samples memory once a second; torch builds its whole statistics table for each
# read (~80 us on an H200's host), so a step reads it at most this often (peaks are kept by
# torch between reads).
MEMORY_EVERY = 0.25
EVERY_STEP_UNTIL = 32  # the first steps' memory is read at each step's end (a fast leak)


def gpu_memory(cuda: Any) -> tuple[int, int, int]:
    """(allocated, peak allocated, reserved) bytes torch holds on the current GPU."""
    stats = cuda.memory_stats()
    return (
        int(stats.get("allocated_bytes.all.current", 0)),
        int(stats.get("allocated_bytes.all.peak", 0)),
        int(stats.get("reserved_bytes.all.current", 0)),
    )


class Clock:
    """The current step's accumulators, and the steps whose GPU timings are still running."""

    def __init__(self, writer: protocol.StepWriter) -> None:
        self.writer = writer
        self.owner: int | None = None  # id() of the optimizer whose steps mark the steps
        self.started: float | None = None  # host time the current step began
        self.number = 0
        self.data = 0.0
        self.own = 0.0  # ddpkit's own time inside the DataLoader (counted as the host's)
        self.comm = 0.0  # host-blocked communication (collectives; DDP's wait on the CPU)
        self.cuda: Any = None  # the torch.cuda module when the optimizer's parameters are there
        self.start_event: Any = None  # GPU: the previous step's end
        self.waits: list[tuple[Any, Any]] = []  # GPU: (last gradient, backward end) per backward
        self.grads_at = 0.0  # host time the last gradient of the current backward was computed
        self.grad_event: Any = None
        self.pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self.spare: list[Any] = []  # CUDA events done with, used again (creating one costs)
        self.order: list[int] = []  # id() of parameters as their gradients came (learning)
        self.hooks: list[tuple[int, Any]] = []
        self.params: list[Any] = []  # the owning optimizer's, while learning the order
        self.learning = False
        self.synced = False  # the job has other ranks to wait for
        self.memory_at = -MEMORY_EVERY  # host time the GPU memory was last read
        # (step, allocated) as steps ended: a leak that fills the GPU within a few steps is
        # seen in them at the out-of-memory error (ddpkit.rank.oom_facts)
        self.memory_series: collections.deque[tuple[int, int]] = collections.deque(maxlen=32)

    # -- the step boundary --------------------------------------------------------------

    def _capturing(self) -> bool:
        """A CUDA graph is being captured (s.graph): no events, no boundary, until replays."""
        return self.cuda is not None and self.cuda.is_current_stream_capturing()

    def after_step(self, optimizer: Any) -> None:
        if self._capturing():
            return
        if self.owner is None:
            self.owner = runtime.current().steps.counting or id(optimizer)
            if id(optimizer) != self.owner:
                return
            self._learn(optimizer)
        elif id(optimizer) != self.owner:
            return
        elif self.learning:
            self._keep_last_hook()
        now = time.perf_counter()
        if self.started is not None:
            self.number += 1
            total = now - self.started
            if self.cuda is not None:
                if now - self.memory_at >= MEMORY_EVERY or self.number <= EVERY_STEP_UNTIL:
                    self.memory_at = now
                    held = gpu_memory(self.cuda)
                    self.writer.set_memory(*held)
                    self.memory_series.append((self.number, held[0]))
                end = self._event()
                end.record()
                self.pending.append(
                    (self.number, time.time(), total, self.data, self.comm, self.start_event,
                     end, self.waits)
                )  # fmt: skip
                self.start_event = end
                self.waits = []
                self._drain()
            else:
                comm = self.comm if self.comm < total else total
                data = self.data if self.data < total - comm else total - comm
                data = data if data > 0.0 else 0.0
                own = self.own if self.own < total - comm - data else total - comm - data
                self.writer.write_values(
                    self.number, time.time(), total, data, total - comm - data - own, comm, own
                )
        elif self.cuda is not None:
            self.start_event = self._event()
            self.start_event.record()
        self.started = time.perf_counter()
        self.data = self.comm = self.own = 0.0
        _beat()

    def _drain(self, wait: bool = False) -> None:
        """Write the steps whose GPU events have completed (all of them with wait=True)."""
        while self.pending:
            number, end_wall, total, data, comm_host, start, end, waits = self.pending[0]
            if not wait and not end.query():
                return
            self.pending.popleft()
            if wait:
                end.synchronize()
            span = start.elapsed_time(end) / 1e3 if start is not None else total
            comm_gpu = sum(g.elapsed_time(b) / 1e3 for g, b in waits)
            # this step's end is the next one's start: every other event of it is free now
            self.spare.extend([start, *(e for pair in waits for e in pair)] if start else [])
            comm = min(comm_host + comm_gpu, total)
            data = min(data, total - comm)
            compute = max(0.0, min(span - comm_gpu, total - comm - data))
            self.writer.write_values(
                number, end_wall, total, data, compute, comm, total - comm - data - compute
            )

    def _event(self) -> Any:
        return self.spare.pop() if self.spare else self.cuda.Event(enable_timing=True)

    # -- the last gradient of a backward --------------------------------------------------

    def _learn(self, optimizer: Any) -> None:
        import torch.distributed as dist

        # a backward waits for peers only when there are some (DDP's all-reduce at the end)
        self.synced = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        groups = getattr(optimizer, "param_groups", None) or []
        params = [p for g in groups for p in g["params"] if p.requires_grad]
        if params and params[0].is_cuda:
            import torch

            self.cuda = torch.cuda
            try:
                props = torch.cuda.get_device_properties(params[0].device)
                self.writer.set_gpu(str(getattr(props, "uuid", "")))
            except Exception:
                pass
        if not hasattr(params[0] if params else None, "register_post_accumulate_grad_hook"):
            return
        self.learning, self.params = True, params
        for p in params:
            self.hooks.append((id(p), p.register_post_accumulate_grad_hook(self._learned)))

    def _learned(self, param: Any) -> None:
        self.order.append(id(param))
        self._grad_done(param)

    def _keep_last_hook(self) -> None:
        """After one step of learning: only the parameter whose gradient came last keeps a
        hook (the order is the same every step of a model without branches)."""
        self.learning = False
        # alone, no backward waits for a peer: no hook is needed at all (it costs a call a step)
        last = self.order[-1] if self.order and self.synced else None
        for _, handle in self.hooks:
            handle.remove()
        self.hooks, self.order = [], []
        for p in self.params:
            if id(p) == last:
                self.hooks.append((last, p.register_post_accumulate_grad_hook(self._grad_done)))
        self.params = []

    def _grad_done(self, param: Any) -> None:
        if self._capturing():
            return
        self.grads_at = time.perf_counter()
        if self.cuda is not None:
            self.grad_event = self._event()
            self.grad_event.record()

    def backward_ended(self, began: float) -> None:
        """After a backward pass: the time from its last gradient to its end was spent
        waiting for DDP's all-reduces (on a GPU: timed by events on the stream)."""
        if not self.synced or self.grads_at < began or self._capturing():
            return  # alone, or no hooked gradient in this backward (another model's)
        if self.cuda is not None:
            if self.grad_event is not None and len(self.waits) < MAX_BACKWARDS:
                end = self._event()
                end.record()
                self.waits.append((self.grad_event, end))
            self.grad_event = None
        else:
            self.comm += time.perf_counter() - self.grads_at


@dataclass
class Timing:
    """The rank's step timing: a part of its runtime (ddpkit.rank.runtime)."""

    clock: Clock | None = None


def clock() -> Clock | None:
    return runtime.current().part(Timing).clock


def waited_in_collective(seconds: float) -> None:
    """The bootstrap's collective wrappers: this rank was blocked that long in one."""
    timing = clock()
    if timing is not None:
        timing.comm += seconds


def not_data(seconds: float) -> None:
    """ddpkit's loader spent `seconds` of the current batch's wait on its own work: not the
    user's data time (on the CPU it is reported as host time; on a GPU host time is what the
    GPU waited for the host, which it already includes)."""
    timing = clock()
    if timing is not None:
        timing.data -= seconds
        timing.own += seconds


def patch_dataloader(module: Any) -> None:
    """Time every DataLoader's `__next__` (torch.utils.data.dataloader, once imported)."""
    base = getattr(module, "_BaseDataLoaderIter", None)
    original = getattr(base, "__next__", None)
    if original is None or getattr(original, "_ddpkit_timed", False):
        return
    call: Any = original

    def timed_next(self: Any) -> Any:
        timing = clock()
        began = time.perf_counter()
        try:
            return call(self)
        finally:
            if timing is not None:
                timing.data += time.perf_counter() - began

    timed_next._ddpkit_timed = True  # type: ignore[attr-defined]
    base.__next__ = timed_next  # type: ignore[method-assign,union-attr]


def patch_backward(autograd: Any) -> None:
    """Time where each backward pass waited for DDP (torch.autograd.backward, which
    Tensor.backward calls)."""
    original = getattr(autograd, "backward", None)
    if original is None or getattr(original, "_ddpkit_timed", False):
        return

    def backward(*args: Any, **kwargs: Any) -> Any:
        timing = clock()
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if timing is not None:
                timing.backward_ended(began)

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    backward.__doc__ = original.__doc__
    backward._ddpkit_timed = True  # type: ignore[attr-defined]
    autograd.backward = backward


def install_optimizer_hooks(optimizer_module: Any) -> None:
    """Called by the bootstrap once torch.optim.optimizer is imported."""
    timing = clock()
    here = runtime.current()
    if timing is not None or os.environ.get(OFF_VARIABLE) == "0" or not here.is_rank():
        return
    try:
        writer = protocol.StepWriter(here.path(protocol.STEPS))
    except OSError:
        return
    runtime.current().part(Timing).clock = Clock(writer)
    here.steps.after(_after_step)
    profiling.arm_from_environment()
    profiling.serve(here.state_dir, here.rank_name, _step_now)
    import atexit

    atexit.register(flush)


def _step_now() -> int:
    timing = clock()
    return timing.number if timing is not None else -1


def _after_step(optimizer: Any) -> None:
    timing = clock()
    if timing is not None:
        timing.after_step(optimizer)
        if profiling.recording().plan is not None:  # `ddpkit profile` armed this rank
            profiling.after_step(timing.number, timing.cuda is not None)


def timed_here(path: Any) -> Any:
    """Time this process's steps into the step record at `path` as a rank's are, and return a
    function that takes every hook out again (benchmarks/step_timing_cost.py compares both in
    one run)."""
    import torch.autograd
    import torch.utils.data.dataloader as dataloader

    saved_next = dataloader._BaseDataLoaderIter.__next__
    saved_backward = torch.autograd.backward
    runtime.current().part(Timing).clock = Clock(protocol.StepWriter(path))
    handle = runtime.current().steps.after(_after_step)
    patch_dataloader(dataloader)
    patch_backward(torch.autograd)

    def remove() -> None:
        timing = clock()
        handle.remove()
        dataloader._BaseDataLoaderIter.__next__ = saved_next  # type: ignore[method-assign]
        torch.autograd.backward = saved_backward
        if timing is not None:
            flush()
            for _, hook in timing.hooks:
                hook.remove()
        runtime.current().part(Timing).clock = None

    return remove


def mark_step(owner: Any) -> None:
    """A step that did not call optimizer.step() (a replayed CUDA graph) ends here."""
    timing = clock()
    if timing is not None:
        timing.after_step(owner)


def flush() -> None:
    """At the end of the script: the steps whose GPU timings were still running."""
    timing = clock()
    if timing is not None and timing.pending:
        try:
            timing._drain(wait=True)
        except Exception:
            pass
