"""`step = s.graph(train_step, *example_inputs)`: a whole training step (forward, backward with
DDP's all-reduce, optimizer step) captured once as a CUDA graph and replayed, so the host no
longer sets the pace of a host-bound step.

Done for the user, in the order PyTorch's CUDA-graphs notes require with DDP: DDP built on a
side stream (`s.wrap` does that on GPUs), NCCL's async error handling off before init
(`ddpkit.setup(graphs=True)`), `warmup` eager steps (DDP needs 11) on a side stream, grads set
to None, then capture. The model's and optimizers' state before the warm-up is put back after
the capture, so the graphed run starts where an eager one would (exactness: losses equal to the
eager run's, bit for bit where the kernels are deterministic and the step draws no random
numbers). Each call copies the new inputs into the captured ones, replays, and returns the
captured outputs (the same tensors every time: clone what you keep) once the previous replay
has ended: one replay stays in flight, as eager CUDA work would, and the wait for it is a
progress record (so the hang watch names a replay that never ends, at the next call or at
close). Reading an output on the host (`loss.item()`) waits for its replay, as in eager code.

Boundaries: on the CPU or gloo there is nothing to capture: the step runs eagerly, with one
warning. Inputs of another shape or dtype than at capture (a short last batch) are an error
naming both (drop_last=True, or pad). An op that cannot be captured is an error naming it.
Optimizers must keep their state on the GPU (Adam/AdamW: capturable=True); a float learning
rate is turned into a tensor so that a schedule's changes reach the graph.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ddpkit.errors import ConfigError
from ddpkit.train.placement import Placement

DDP_WARMUP = 11  # DDP's eager iterations before capture (PyTorch's CUDA-graphs notes)
ASYNC_VARIABLE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def check_setup(backend: str, world_size: int) -> None:
    if backend == "nccl" and world_size > 1 and os.environ.get(ASYNC_VARIABLE) != "0":
        raise ConfigError(
            "s.graph with DDP needs NCCL's async error handling off before the process group "
            f"is made ({ASYNC_VARIABLE}=0), as PyTorch's CUDA-graphs notes require",
            fix="call ddpkit.setup(graphs=True), which sets it before init",
        )


class GraphedStep:
    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        models: Sequence[torch.nn.Module],
        warmup: int,
    ) -> None:
        self.fn = fn
        self.optimizers = list(optimizers)
        self.static_inputs = [x.detach().clone() for x in inputs]
        for opt in optimizers:
            _make_capturable(opt)
        saved = _snapshot(models, optimizers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _quiet_stream_mismatch():
            for _ in range(warmup):
                self._eager_step(optimizers)
        torch.cuda.current_stream().wait_stream(side)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)  # grads come from the graph's own memory pool
        _restore(saved, models, optimizers)
        self.graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph), _quiet_stream_mismatch():
                self.static_outputs = fn(*self.static_inputs)
        except RuntimeError as err:
            raise ConfigError(
                f"the step could not be captured as a CUDA graph: {str(err).splitlines()[0]}",
                fix="keep ops that sync with the host (.item(), printing tensors, data-dependent "
                "shapes) out of the step, or run the step eagerly",
            ) from err
        torch.cuda.synchronize()
        self.in_flight: tuple[torch.cuda.Event, str] | None = None
        # learning rates the graph holds as constants (optimizers that take them as floats)
        self.baked = [
            (opt, i, group["lr"])
            for opt in self.optimizers
            for i, group in enumerate(opt.param_groups)
            if isinstance(group.get("lr"), float)
        ]

    def release(self) -> None:
        """Free the graph (and the NCCL work it holds), before the process group goes."""
        graph = getattr(self, "graph", None)
        if graph is not None:
            if getattr(self, "in_flight", None) is not None:
                self._wait(*self.in_flight)  # type: ignore[misc]
            torch.cuda.synchronize()
            graph.reset()
            self.graph = None

    def _eager_step(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        self.fn(*self.static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        for opt, i, lr in self.baked:
            if opt.param_groups[i]["lr"] != lr:
                raise ConfigError(
                    f"the learning rate of {type(opt).__name__} changed after capture "
                    f"({lr} -> {opt.param_groups[i]['lr']}), and this optimizer reads it as a "
                    "constant the graph holds",
                    fix=f"make it {type(opt).__name__}(..., fused=True) (or capturable=True for "
                    "Adam/AdamW), which read the learning rate from the GPU",
                )
        if self.graph is None:
            raise ConfigError(
                "the graphed step was released (its session was closed)",
                fix="call it inside the `with ddpkit.setup() as s:` block that made it",
            )
        if len(inputs) != len(self.static_inputs):
            raise ConfigError(
                f"the graphed step takes {len(self.static_inputs)} inputs, got {len(inputs)}",
                fix="call it with the same inputs as at s.graph(...)",
            )
        for static, new in zip(self.static_inputs, inputs, strict=True):
            if new.shape != static.shape or new.dtype != static.dtype:
                raise ConfigError(
                    f"an input of shape {list(new.shape)} ({new.dtype}) after capture with "
                    f"{list(static.shape)} ({static.dtype}): a graph replays fixed shapes",
                    fix="give the loader drop_last=True (a short last batch), or pad inputs to "
                    "the captured shape",
                )
            static.copy_(new, non_blocking=True)
        caller = sys._getframe(1)
        site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        self.graph.replay()
        # a replay runs the optimizer's step without calling optimizer.step(): mark it
        from ddpkit.rank.steps import mark_step

        mark_step(self.optimizers[0] if self.optimizers else self)
        done = torch.cuda.Event()
        done.record()
        # One replay in flight: this call returns once the previous one is done, so the GPU
        # has the next step queued while the host prepares it (a wait per call made each rank's
        # step start with its own host, and the all-reduce wait for the slower one). A replay
        # that never ends is still waited for inside a progress record: at the next call, or
        # at close.
        previous, self.in_flight = self.in_flight, (done, site)
        if previous is not None:
            self._wait(*previous)
        return self.static_outputs

    def _wait(self, done: torch.cuda.Event, site: str) -> None:
        from ddpkit.rank.progress import writer

        record = writer()
        if record is not None:
            record.enter("graph replay", "", site)
        try:
            done.synchronize()
        finally:
            if record is not None:
                record.leave("graph replay", "", site)


class EagerStep:
    """Where there is nothing to capture (CPU, gloo): the step as it is."""

    def release(self) -> None:
        pass

    def __init__(self, fn: Callable[..., Any], why: str) -> None:
        self.fn = fn
        warnings.warn(f"s.graph: {why}; the step runs eagerly", stacklevel=3)

    def __call__(self, *inputs: Any) -> Any:
        return self.fn(*inputs)


def capture(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    optimizers: Sequence[torch.optim.Optimizer],
    models: Sequence[torch.nn.Module],
    place: Placement,
    warmup: int,
) -> GraphedStep | EagerStep:
    device, backend, world_size = place.device, place.backend, place.world_size
    if device.type != "cuda":
        return EagerStep(fn, "CUDA graphs need a GPU and this rank runs on the CPU")
    check_setup(backend, world_size)
    if not all(isinstance(x, torch.Tensor) for x in inputs):
        raise ConfigError(
            "s.graph(step, *inputs): every input must be a tensor (they become the captured "
            "buffers each call copies into)",
            fix="pass the batch's tensors, e.g. s.graph(step, x, y)",
        )
    if world_size > 1 and warmup < DDP_WARMUP:
        raise ConfigError(
            f"s.graph(warmup={warmup}): DDP needs {DDP_WARMUP} eager steps before capture",
            fix=f"leave warmup out, or give {DDP_WARMUP} or more",
        )
    for opt in optimizers:
        if "capturable" in opt.defaults and not opt.defaults["capturable"]:
            raise ConfigError(
                f"{type(opt).__name__} keeps its step counters on the host, which a graph "
                "cannot update",
                fix=f"make it with capturable=True: {type(opt).__name__}(..., capturable=True)",
            )
    return GraphedStep(fn, [x.to(device) for x in inputs], optimizers, models, warmup)


def _takes_tensor_lr(opt: torch.optim.Optimizer) -> bool:
    """Adam/AdamW with capturable=True and fused optimizers read lr from device memory."""
    return bool(opt.defaults.get("capturable") or opt.defaults.get("fused"))


def _make_capturable(opt: torch.optim.Optimizer) -> None:
    """A float learning rate becomes a tensor on the GPU where the optimizer reads it from
    there, so that a schedule writing a new value into it changes what the graph reads."""
    if not _takes_tensor_lr(opt):
        return
    device = next((p.device for g in opt.param_groups for p in g["params"]), None)
    for group in opt.param_groups:
        if isinstance(group.get("lr"), float) and device is not None:
            group["lr"] = torch.tensor(group["lr"], device=device)


def _snapshot(
    models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> list[Any]:
    state: list[Any] = []
    for model in models:
        state.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    for opt in optimizers:
        state.append(
            (
                {id(p): {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()},
                [_clone(g.get("lr")) for g in opt.param_groups],
            )
        )
    return state


def _restore(
    state: list[Any], models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Back to the state before the warm-up, in place (the graph keeps these addresses)."""
    with torch.no_grad():
        for model, saved in zip(models, state, strict=False):
            for k, v in model.state_dict().items():
                v.copy_(saved[k])
        for opt, (saved_state, lrs) in zip(optimizers, state[len(models) :], strict=True):
            for p, s in opt.state.items():
                before = saved_state.get(id(p))
                for k, v in s.items():
                    if before is not None and k in before and isinstance(v, torch.Tensor):
                        v.copy_(before[k])
                    elif isinstance(v, torch.Tensor):
                        v.zero_()  # made during the warm-up: as new
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                if isinstance(group.get("lr"), torch.Tensor) and lr is not None:
                    group["lr"].copy_(lr)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class _quiet_stream_mismatch:  # noqa: N801 - a context manager, named as one
    """The warm-up runs on a side stream by design (PyTorch's CUDA-graphs notes): autograd's
    warning that its streams differ from the model's says nothing the user can act on."""

    def __enter__(self) -> None:
        setter = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
        self.setter = setter
        if setter is not None:
            setter(False)

    def __exit__(self, *exc: object) -> None:
        if self.setter is not None:
            self.setter(True)


class Captured:
    """The graphed steps a session made (held weakly), released together at its close."""

    def __init__(self) -> None:
        self._steps: list[weakref.ref[Any]] = []

    def add(self, step: Any) -> None:
        self._steps.append(weakref.ref(step))

    def release(self) -> bool:
        """Free every graph still alive (they hold NCCL work); True if there were any."""
        steps = [ref() for ref in self._steps]
        self._steps = []
        for step in steps:
            if step is not None:
                step.release()
        return any(step is not None for step in steps)
