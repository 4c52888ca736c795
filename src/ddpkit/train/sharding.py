"""`s.wrap(model, shard=True)`: the model sharded with FSDP2 (`torch.distributed.fsdp.
fully_shard`), for models whose parameters, gradients and optimizer state do not fit one GPU.

Each unit (a transformer's layers: every child of an `nn.ModuleList`/`nn.Sequential` whose
children are two or more of one class; or the classes, or the modules a callable picks, given
as `shard=`) is sharded on its own, then the root; each rank keeps 1/N of every parameter
(dim 0, up to one row) and gathers a unit's parameters just before it runs. The session's
precision becomes FSDP2's mixed precision as torchtitan sets it: bf16 parameters in forward and
backward, gradients reduced in fp32. reshard_after_forward: True for every unit but the last
(its parameters are needed again at once by backward) and for the root's own parameters
(docs/sharding.md has the measurement). World size 1: the model itself, as `s.wrap` does.

Needs torch 2.6 (fully_shard public), and 2.11 on gloo: before, FSDP2's averaged gradients
were scaled by the world size on gloo (pytorch#162338, fixed by #171458).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.train.placement import Placement

NEEDS = (2, 6)
NEEDS_ON_GLOO = (2, 11)
Choice = bool | Sequence[type] | Callable[[nn.Module], bool]


def torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return (99, 0)


def check_torch(backend: str) -> None:
    """A ConfigError naming the version and the fix, before anything is sharded."""
    have = torch_version()
    need = NEEDS_ON_GLOO if backend == "gloo" else NEEDS
    if have >= need:
        return
    why = (
        "FSDP2 (torch.distributed.fsdp.fully_shard) is public from torch 2.6"
        if have < NEEDS
        else "before torch 2.11, FSDP2 on gloo scales the averaged gradients by the world "
        "size (pytorch#162338)"
    )
    raise ConfigError(
        f"s.wrap(shard=True) needs torch {need[0]}.{need[1]} or newer on {backend}; this is "
        f"torch {torch.__version__}: {why}",
        fix=f"pip install 'torch>={need[0]}.{need[1]}'"
        + (", or shard on GPUs with NCCL (torch 2.6 or newer)" if backend == "gloo" else ""),
    )


def is_sharded(model: Any) -> bool:
    """The model (or a module in it) is an FSDP2 module."""
    try:
        from torch.distributed.fsdp import FSDPModule  # type: ignore[attr-defined]  # torch >= 2.6
    except ImportError:
        return False
    if not isinstance(model, nn.Module):
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def units(model: nn.Module, shard: Choice) -> list[nn.Module]:
    """The modules sharded on their own, outermost first (never one inside another)."""
    if shard is True:
        picked = _repeated_blocks(model)
    elif callable(shard) and not isinstance(shard, type):
        picked = [m for m in model.modules() if m is not model and shard(m)]
    else:
        classes = tuple(shard)  # type: ignore[arg-type]
        if not classes or not all(isinstance(c, type) for c in classes):
            raise ConfigError(
                f"s.wrap(shard={shard!r}) is not True, a list of module classes or a callable",
                fix="e.g. s.wrap(model, shard=True) or s.wrap(model, shard=[Block])",
            )
        picked = [m for m in model.modules() if m is not model and isinstance(m, classes)]
    outermost: list[nn.Module] = []
    inside: set[int] = set()
    for m in picked:  # model.modules() order: a parent before its children
        if id(m) in inside:
            continue
        outermost.append(m)
        inside.update(id(c) for c in m.modules())
    return outermost


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    found = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList | nn.Sequential):
            children = list(m.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                found.extend(children)
    return found


def shard(model: nn.Module, choice: Choice, place: Placement, precision: str) -> nn.Module:
    """fully_shard each unit, then the root, on a 1-D mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[attr-defined]  # torch >= 2.6

    mesh = init_device_mesh(place.device.type, (place.world_size,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    blocks = units(model, choice)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    return model


def shard_for_session(
    model: nn.Module,
    choice: Choice,
    place: Placement,
    precision: str,
    graphs: bool,
    compress: str | None,
    ddp_kwargs: dict[str, Any],
) -> nn.Module:
    """s.wrap(shard=...): the model on this rank's device, sharded with FSDP2 when the job has
    more than one process; what cannot go with sharding is refused with the reason."""
    if compress is not None or ddp_kwargs:
        given = ", ".join([*(["compress"] if compress else []), *ddp_kwargs])
        raise ConfigError(
            f"s.wrap(shard=...) takes no DDP options ({given})",
            fix="leave them out: a sharded model reduces gradients with FSDP2's own "
            "reduce-scatter (in fp32 under bf16 precision)",
        )
    if graphs:
        raise ConfigError(
            "s.wrap(shard=True) with setup(graphs=True): FSDP2's hooks all-gather and free "
            "parameters on the host, which a captured CUDA graph cannot replay",
            fix="run sharded steps eagerly: leave graphs=True out",
        )
    check_torch(place.backend)
    model = model.to(place.device)
    if not place.alone:
        shard(model, choice, place, precision)
    return model


def full_state_dict(model: nn.Module, place: Placement) -> dict[str, Any]:
    """Collective: the model's whole state dict on rank 0, on the CPU, plain tensors
    (`torch.save`-loadable, no ddpkit needed to read it); {} on the other ranks. For a
    sharded model the shards are gathered; for others it is the unwrapped state_dict."""
    from ddpkit.train.wrapping import unwrap

    inner = unwrap(model)
    if is_sharded(inner):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        found = get_model_state_dict(inner, options=options)
        return dict(found) if place.is_main else {}
    if not place.is_main:
        return {}
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()}


def full_tensors(obj: Any) -> Any:
    """`obj` with every DTensor gathered whole (collective: every rank calls it with the same
    structure, as state_dict() gives); other values as they are."""
    try:
        from torch.distributed.tensor import DTensor  # type: ignore[attr-defined]  # torch >= 2.5
    except ImportError:
        return obj
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return type(obj)((k, full_tensors(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def has_dtensors(obj: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor  # type: ignore[attr-defined]  # torch >= 2.5
    except ImportError:
        return False
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, dict):
        return any(has_dtensors(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(has_dtensors(v) for v in obj)
    return False
