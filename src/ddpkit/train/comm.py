"""Collectives on plain Python values: `reduce` and `gather` over every rank, `broadcast` from
rank 0, `barrier`.

They take floats, ints, tensors and dicts (or lists/tuples) of them, return the same structure
on every rank, and work at world size 1 without a process group. Tensors of different shapes on
different ranks can be gathered; anything picklable can be gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError
from ddpkit.train.placement import Placement

_MAX_DIMS = 8
_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def reduce(value: Any, place: Placement, op: str = "mean") -> Any:
    """All-reduce `value` (number, tensor, or a dict/list/tuple of them) with op
    sum | mean | max | min; every rank gets the result, in the structure it passed."""
    if op not in _OPS:
        raise ConfigError(
            f"reduce(op={op!r}) is not one of {sorted(_OPS)}",
            fix="use op='mean', 'sum', 'max' or 'min'",
        )
    leaves: list[Any] = []
    _flatten(value, leaves)
    if not leaves:
        return value
    # One collective for the whole structure: every leaf flattened into one float64 vector.
    device = place.comm_device
    parts = [
        torch.as_tensor(x).detach().reshape(-1).to(device=device, dtype=torch.float64)
        for x in leaves
    ]
    flat = torch.cat(parts)
    world = _world()
    if world > 1:
        dist.all_reduce(flat, op=getattr(dist.ReduceOp, _OPS[op]))
    if op == "mean":
        flat = flat / world
    results: list[Any] = []
    offset = 0
    for x in leaves:
        n = torch.as_tensor(x).numel()
        chunk = flat[offset : offset + n]
        offset += n
        if isinstance(x, torch.Tensor):
            dtype = x.dtype if x.is_floating_point() or op != "mean" else torch.float64
            results.append(chunk.reshape(x.shape).to(device=x.device, dtype=dtype))
        elif isinstance(x, bool) or (isinstance(x, int) and op != "mean"):
            results.append(type(x)(chunk.item()))
        else:
            results.append(float(chunk.item()))
    return _rebuild(value, iter(results))


def gather(value: Any, place: Placement) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank. Tensors (any shape per rank, same
    dtype and number of dimensions) travel as tensors and land on this rank's device; other
    objects are pickled."""
    world = _world()
    if world == 1:
        return [value]
    device = place.comm_device
    if not isinstance(value, torch.Tensor):
        out: list[Any] = [None] * world
        dist.all_gather_object(out, value)
        return out
    if value.dim() > _MAX_DIMS:
        raise ConfigError(
            f"gather() takes tensors of at most {_MAX_DIMS} dimensions",
            fix="reshape the tensor before gathering",
        )
    # Fixed-length shape records, so ranks that disagree on dimensions get an error, not a hang.
    record = [value.dim(), *value.shape] + [0] * (_MAX_DIMS - value.dim())
    shape = torch.tensor(record, dtype=torch.int64, device=device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    dims = {int(s[0]) for s in shapes}
    if len(dims) > 1:
        raise ConfigError(
            "gather() got tensors with different numbers of dimensions across ranks: "
            f"{sorted(dims)}",
            fix="reshape so every rank passes the same number of dimensions",
        )
    sizes = [tuple(int(d) for d in s[1 : 1 + value.dim()].tolist()) for s in shapes]
    numels = [int(torch.tensor(sz, dtype=torch.int64).prod().item()) for sz in sizes]
    padded = torch.zeros(max(numels), dtype=value.dtype, device=device)
    padded[: value.numel()] = value.reshape(-1).to(device)
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded)
    return [c[:n].reshape(sz) for c, n, sz in zip(chunks, numels, sizes, strict=True)]


def broadcast(value: Any, place: Placement) -> Any:
    """Rank 0's `value` (anything picklable) on every rank."""
    if place.alone or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=place.comm_device)
    return box[0]


def barrier(place: Placement) -> None:
    if dist.is_initialized() and not place.alone:
        if place.device.type == "cuda":
            dist.barrier(device_ids=[place.device.index])
        else:
            dist.barrier()


def _flatten(value: Any, out: list[Any]) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _flatten(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _flatten(v, out)
    elif isinstance(value, torch.Tensor | int | float):
        out.append(value)
    else:
        raise ConfigError(
            f"reduce() cannot reduce a {type(value).__name__}",
            fix="pass numbers or tensors (or a dict/list of them); use gather() for objects",
        )


def _rebuild(value: Any, results: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rebuild(v, results) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_rebuild(v, results) for v in value)
    return next(results)
