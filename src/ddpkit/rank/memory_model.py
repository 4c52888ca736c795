"""What the model and the failing step held when a rank ran out of memory, found in the rank
(its live objects and the error's traceback): parameters, gradients and optimizer state on the
device, each tensor counted once; the state the optimizers will hold once they have stepped
(Adam keeps two tensors per parameter, made at its first step); the batch of the forward that
failed, read from its inputs; whether it failed in the forward, the backward or the optimizer;
the number of repeated blocks (a transformer's layers) and the parameters' float type, which
size activation checkpointing and autocast. `ddpkit.launch.oom_verdict` turns these into fixes.

The scan walks every object the garbage collector tracks, so it checks types with `type()`
and silences warnings: an isinstance() on some of torch's deprecated objects warns (the scan
printed torch's `reduce_op is deprecated` three times into a rank's output)."""

from __future__ import annotations

import gc
import warnings
from types import TracebackType
from typing import Any

from ddpkit.common import protocol

# optimizer state tensors per parameter, by optimizer class name, once it has stepped
SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "SparseAdam": 2,
         "Adagrad": 1, "Adadelta": 2, "Rprop": 2, "ASGD": 1, "LBFGS": 2}  # fmt: skip


def _slots(opt: Any) -> int:
    name = type(opt).__name__
    if name in SLOTS:
        return SLOTS[name]
    defaults = getattr(opt, "defaults", {}) or {}
    if name == "SGD":
        return 1 if defaults.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum")) + bool(defaults.get("centered"))
    return 0


def live_objects() -> tuple[list[Any], list[Any]]:
    """(modules, optimizers) alive in the process."""
    import torch

    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    modules, optimizers = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            kind = type(obj)
            if issubclass(kind, module_type):
                modules.append(obj)
            elif issubclass(kind, optimizer_type):
                optimizers.append(obj)
    return modules, optimizers


def held(device: Any, modules: list[Any], optimizers: list[Any]) -> protocol.OomFacts:
    """Bytes on `device` of parameters, gradients and optimizer state (each tensor once); what
    gradients and optimizer state take at the step's peak; the parameters' float type."""
    import torch

    seen: set[int] = set()

    def size(t: Any) -> int:
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): this rank's shard
        if not isinstance(t, torch.Tensor) or t.device.type != device.type:
            return 0
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen:
            return 0
        seen.add(key)
        return int(t.untyped_storage().nbytes())

    params = grads = states = trainable = 0
    fp32 = other_float = 0
    for module in modules:
        for p in module.parameters(recurse=False):
            n = size(p)
            params += n
            if p.requires_grad:
                trainable += n
            if p.dtype == torch.float32:
                fp32 += n
            elif p.is_floating_point():
                other_float += n
    for module in modules:
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                grads += size(p.grad)
    expected = 0
    for opt in optimizers:
        for per_param in opt.state.values():
            for value in per_param.values():
                states += size(value)
        slots = _slots(opt)
        for group in opt.param_groups:
            for p in group.get("params", []):
                local = getattr(p, "_local_tensor", p)
                if isinstance(local, torch.Tensor) and local.device.type == device.type:
                    expected += slots * local.numel() * local.element_size()
    return {
        "params": params,
        "grads": grads,
        "optimizer": states,
        # at the step's peak: every trainable parameter's gradient, and the optimizer's state
        # once it has stepped (Adam makes its state at the first step)
        "grads_expected": trainable,
        "optimizer_expected": max(states, expected),
        "fp32": fp32 > other_float,
    }


def blocks(modules: list[Any]) -> int:
    """The most repeated blocks in one container (a transformer's layers): how finely
    activation checkpointing can cut the activations. 0 when no container repeats a block."""
    import torch

    most = 0
    for module in modules:
        if isinstance(module, torch.nn.ModuleList | torch.nn.Sequential):
            kinds = [type(m) for m in module]
            if kinds:
                common = max(kinds.count(k) for k in set(kinds))
                # a block has parts of its own (a transformer layer), not one Linear
                if common > most and any(True for _ in module[0].children()):
                    most = common
    return most


def failing_step(tb: TracebackType | None) -> tuple[str, int | None]:
    """(where in the step it failed: 'forward', 'backward', 'optimizer' or '', the batch of the
    outermost module call in the traceback: its first tensor input's first dimension)."""
    import torch

    phase, batch = "", None
    module_type = torch.nn.Module
    outermost_seen = False
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        name, file = code.co_name, code.co_filename.replace("\\", "/")
        local_self = frame.f_locals.get("self")
        if name in ("_call_impl", "_wrapped_call_impl", "forward") and issubclass(
            type(local_self), module_type
        ):
            phase = phase or "forward"
            if not outermost_seen:
                outermost_seen = True
                batch = _batch_of(frame.f_locals)
        elif name in ("backward", "_engine_run_backward") and "/torch/" in file:
            phase = "backward"
        elif name == "step" and "/torch/optim/" in file:
            phase = "optimizer"
        tb = tb.tb_next
    return phase, batch


def _batch_of(local: dict[str, Any]) -> int | None:
    """The first dimension of the first tensor among a module call's inputs."""
    import torch

    candidates: list[Any] = list(local.get("args") or ()) + list(
        (local.get("kwargs") or {}).values()
    )
    if not candidates:  # a forward(self, x, ...) frame: its own arguments
        candidates = [v for k, v in local.items() if k != "self"]
    for value in candidates:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    return None


def loader_batch() -> int | None:
    """The batch size of the DataLoader in use (the one of ddpkit's loaders, or torch's, with
    the most batches taken); None when none is found."""
    try:
        from torch.utils.data import DataLoader
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if issubclass(type(o), DataLoader) and o.batch_size]
    if not found:
        return None
    found.sort(key=lambda loader: getattr(loader, "_taken", 0), reverse=True)
    return int(found[0].batch_size or 0) or None
