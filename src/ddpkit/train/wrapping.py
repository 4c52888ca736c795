"""Model wrapping: `s.wrap`'s DDP (its defaults each from a measurement) and `unwrap`."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.train.placement import Placement

# DDP options s.wrap sets unless given, each from benchmarks/RESULTS.md (2 H200s, GPT-2-small
# shape, bf16): bigger buckets cut step time 6.9% (fewer, fuller NCCL calls); gradients as
# views of the buckets save a copy and a gradient's worth of memory (1.1%); 50-400 MB buckets
# tie, 25 MB (torch's) is 3-6% slower. static_graph gained nothing and is unsafe for models
# whose graph changes, so it stays off. broadcast_buffers=False is added only for models whose
# buffers are all BatchNorm statistics (-9.5% on a ResNet-50 shape; docs/bench-ddp.md).
WRAP_DEFAULTS = {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}


def buffers_are_batchnorm_statistics(model: nn.Module) -> bool:
    """True when the model has buffers and every one is a BatchNorm running statistic. Then
    DDP's per-forward broadcast of them from rank 0 can go: training uses batch statistics,
    and rank 0 (the broadcast's source, whose state is saved) holds the same values either
    way; only the other ranks keep their own running averages instead of rank 0's."""
    norm_buffers = {
        id(b)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for b in m.buffers(recurse=False)
    }
    buffers = list(model.buffers())
    return bool(buffers) and all(id(b) in norm_buffers for b in buffers)


def unwrap(model: nn.Module) -> nn.Module:
    """The nn.Module inside DistributedDataParallel and torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) if _is_ddp(model) else None
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return isinstance(model, DistributedDataParallel | DataParallel)


COMPRESSIONS = (None, "bf16", "fp16")


def wrap_ddp(
    model: nn.Module,
    place: Placement,
    graphs: bool = False,
    compress: str | None = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """`model` on this rank's device, in DistributedDataParallel when the job has more than
    one process (device_ids = this LOCAL rank on GPU), with WRAP_DEFAULTS unless given.
    compress="bf16"|"fp16" all-reduces gradients in half precision. graphs=True builds DDP on
    a side stream, as a CUDA graph of the step needs (s.graph)."""
    import torch

    if compress not in COMPRESSIONS:
        raise ConfigError(
            f"wrap(compress={compress!r}) is not 'bf16', 'fp16' or None",
            fix="use compress='bf16' for slow links, or leave it out",
        )
    if compress == "bf16" and not place.alone and place.backend != "nccl":
        raise ConfigError(
            f"wrap(compress='bf16') needs the nccl backend; this job uses {place.backend}",
            fix="use compress='fp16' on gloo, or run on GPUs with NCCL",
        )
    model = model.to(place.device)
    if place.alone:
        return model
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.train import bucket_layout

    for option, value in WRAP_DEFAULTS.items():
        ddp_kwargs.setdefault(option, value)
    if buffers_are_batchnorm_statistics(model) and "broadcast_buffers" not in ddp_kwargs:
        # torch 2.13 renamed it, and warns on every rank at the old name; the new one still
        # syncs the buffers once at wrap (rank 0's, the same start)
        known = inspect.signature(DistributedDataParallel.__init__).parameters
        ddp_kwargs.setdefault(
            "forward_sync_buffers" if "forward_sync_buffers" in known else "broadcast_buffers",
            False,
        )
    if place.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [place.device.index])
        ddp_kwargs.setdefault("output_device", place.device.index)
    if place.device.type == "cuda" and graphs:
        # built on a side stream, as a CUDA graph of the step needs (s.graph; the capture
        # fails without it). Only then: eager steps on the default stream would make autograd
        # warn about the streams not matching.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            wrapped = DistributedDataParallel(model, **ddp_kwargs)
        torch.cuda.current_stream().wait_stream(side)
    else:
        wrapped = DistributedDataParallel(model, **ddp_kwargs)
    hook = None
    if compress is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = getattr(default_hooks, f"{compress}_compress_hook")
    if graphs:  # a captured step keeps DDP's buckets of its capture
        if hook is not None:
            wrapped.register_comm_hook(dist.group.WORLD, hook)
    else:  # the first step sums as every later one: exact resume (bucket_layout)
        bucket_layout.install(wrapped, inner=hook)
    return wrapped
