"""Model wrapping: `s.wrap`'s DDP defaults (each from a measurement) and `unwrap`."""

from __future__ import annotations

from torch import nn

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
