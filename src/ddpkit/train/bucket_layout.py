"""Every DDP step, a process's first included, sums gradients in one bucket layout, so a resumed
run equals the run that never stopped at any world size.

Why: with find_unused_parameters=False, DDP puts every parameter in one bucket for a process's
first step and rebuilds its buckets in gradient-ready order after it. A float sum over three or
more ranks depends on where an element sits in the bucket (gloo and NCCL cut a bucket into one
chunk per rank and start each chunk's sum at another rank), so a fresh process's first step,
the first step of a resume, summed in another order than the never-stopped run did at that
step: one ulp, then drift (two ranks were exact: a sum of two does not depend on its order).

How: `install(ddp)` registers a DDP communication hook. Until DDP has rebuilt its buckets, the
hook sums the one bucket as the buckets DDP is about to build: this step's gradient-ready order
(post-accumulate-grad hooks, removed once the rebuild is done), cut by DDP's own function
(`dist._compute_bucket_assignment_by_size`) with DDP's rebuild limits, each piece in the
parameter's memory order, as DDP lays out a bucket. Rank 0's order is used by every rank, as
DDP's rebuild does. After the rebuild the hook is torch's `allreduce_hook` (or the compression
hook asked for) on DDP's own buckets. The first rebuilt step compares DDP's layout with the one
predicted and says so on stderr if they differ (the resume would then not be exact).

Costs nothing per step but a Python call per bucket; the first step runs its all-reduces after
the backward instead of overlapped with it.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

Hook = Callable[[Any, Any], torch.futures.Future]


def find_ddp(obj: Any) -> Any:
    """The DistributedDataParallel inside `obj` (itself, or under torch.compile), or None."""
    while isinstance(obj, nn.Module):
        if isinstance(obj, TorchDDP):
            return obj
        obj = getattr(obj, "_orig_mod", None)
    return None


def installed(ddp: Any) -> bool:
    return isinstance(getattr(ddp, "_ddpkit_layout", None), LayoutState)


def install(ddp: Any, inner: Hook | None = None, inner_state: Any = None) -> bool:
    """Register the hook on `ddp` (a DistributedDataParallel); `inner(inner_state, bucket)` does
    the reduction of each bucket (default: torch's allreduce_hook). A hook the script registers
    later takes the reduction's place (then the first step is summed as that hook does). False,
    and nothing done, where DDP already has a communication hook that is not ours."""
    if installed(ddp):
        return True
    if getattr(ddp, "_comm_hooks", None):
        return False
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state = LayoutState(ddp, inner or default_hooks.allreduce_hook, inner_state)
    if type(ddp) is TorchDDP:
        ddp.__class__ = DistributedDataParallel  # the script's own register_comm_hook works
    ddp._ddpkit_layout = state
    TorchDDP.register_comm_hook(ddp, state, _layout_hook)
    return True


class DistributedDataParallel(TorchDDP):
    """torch's DistributedDataParallel (a subclass, named alike) whose first step sums as its
    later ones; a communication hook registered on it replaces how buckets are reduced, as on
    DDP. A copy of it (deepcopy, pickle) is torch's own class again, with a reducer of its own."""

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        layout = getattr(self, "_ddpkit_layout", None)
        if not isinstance(layout, LayoutState):
            super().register_comm_hook(state, hook)
            return
        self._check_comm_hook(hook)
        if layout.replaced:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        layout.take(hook, state, known=False)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        layout = getattr(self, "_ddpkit_layout", None)
        if not isinstance(layout, LayoutState):
            super()._register_builtin_comm_hook(comm_hook_type)
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {
            "ALLREDUCE": default_hooks.allreduce_hook,
            "FP16_COMPRESS": default_hooks.fp16_compress_hook,
        }[comm_hook_type.name]
        layout.take(hook, self.process_group, known=True)

    def __getstate__(self) -> dict[str, Any]:  # a copy is a plain DDP with a new reducer
        attrs = super().__getstate__()
        attrs.pop("_ddpkit_layout", None)
        attrs["_comm_hooks"] = []  # ours, which holds the process group
        return attrs

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__class__ = TorchDDP  # type: ignore[assignment]


class LayoutState:
    """The hook's state: the DDP (weakly), the reduction, and this step's gradient-ready order."""

    def __init__(self, ddp: Any, inner: Hook, inner_state: Any) -> None:
        self.ddp = weakref.ref(ddp)
        self.group = ddp.process_group
        self.inner = inner
        self.inner_state = inner_state if inner_state is not None else ddp.process_group
        # DDP rebuilds only when it does not look for unused parameters (or the graph is static)
        self.rebuilds = bool(getattr(ddp, "static_graph", False)) or not ddp.find_unused_parameters
        self.ready: list[int] = []  # id() of each parameter as its gradient became ready
        self.handles: list[Any] = []
        self.predicted: list[list[int]] | None = None  # the first step's pieces, to check
        self.index_of: dict[int, int] = {}  # id(parameter) -> its index in DDP's Reducer
        self.checking: dict[int, list[int]] = {}
        if self.rebuilds:
            for p in ddp.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._ready))
        self.params = [p for p in ddp.parameters() if p.requires_grad]

    replaced = False  # the script registered its own hook

    def take(self, hook: Hook, hook_state: Any, known: bool) -> None:
        """The script's hook reduces from now on. torch's own hooks only read a bucket's
        buffer and keep the first step lined up; another hook gets DDP's buckets as they are."""
        self.inner, self.inner_state, self.replaced = hook, hook_state, True
        if not known:
            self.rebuilds = False
            self.stop_watching()

    def _ready(self, param: torch.Tensor) -> None:
        self.ready.append(id(param))

    def rebuilt(self) -> bool:
        ddp = self.ddp()
        return not self.rebuilds or ddp is None or bool(getattr(ddp, "_has_rebuilt_buckets", True))

    def stop_watching(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.ready = []


def _layout_hook(state, bucket):  # no annotations: DDP compares them with its own classes
    if isinstance(bucket, tuple):  # DDP's Python reducer (compiled autograd): one gradient
        return state.inner(state.inner_state, bucket)
    if state.rebuilt():
        if state.handles:
            state.stop_watching()
        if state.predicted is not None:
            _check(state, bucket)
        return state.inner(state.inner_state, bucket)
    pieces = _first_step_layout(state, bucket)
    state.ready = []
    if pieces is None:  # not the one bucket of a first step (several dtypes): leave DDP be
        state.stop_watching()
        state.rebuilds = False
        return state.inner(state.inner_state, bucket)
    buffer = bucket.buffer()
    futures = []
    for index, segments in enumerate(pieces):
        flat = torch.cat([buffer.narrow(0, start, length) for start, length in segments])
        futures.append(
            state.inner(state.inner_state, _Piece(flat, index, index == len(pieces) - 1))
        )

    def put_back(_: Any) -> torch.Tensor:
        for future, segments in zip(futures, pieces, strict=True):
            reduced = future.value()
            reduced = reduced[0] if isinstance(reduced, list | tuple) else reduced
            offset = 0
            for start, length in segments:
                buffer.narrow(0, start, length).copy_(reduced.narrow(0, offset, length))
                offset += length
        return buffer

    return torch.futures.collect_all(futures).then(put_back)


class _Piece:
    """What a reduction hook reads of a GradBucket, for one bucket DDP is about to build."""

    def __init__(self, flat: torch.Tensor, index: int, last: bool) -> None:
        self._flat, self._index, self._last = flat, index, last

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._flat.copy_(tensor)


def _first_step_layout(state: LayoutState, bucket: Any) -> list[list[tuple[int, int]]] | None:
    """The buckets DDP will rebuild to, as (start, length) segments of this one bucket; None
    where this is not the one bucket of a step before the rebuild (decided alike on every
    rank: the model's shape and rank 0's order decide)."""
    params = list(bucket.parameters())
    if not (bucket.index() == 0 and bucket.is_last() and len(params) == len(state.params)):
        return None
    n = len(params)
    position = {id(p): i for i, p in enumerate(params)}
    order = [position[i] for i in state.ready[-n:] if i in position]
    if sorted(order) != list(range(n)):
        order = [-1] * n
    order = _rank0s(order, state.group, params[0].device)
    if sorted(order) != list(range(n)):
        return None
    state.index_of = position
    limits = _rebuild_limits(state.ddp())
    ordered = [params[i] for i in order]
    reverse = os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1"  # DDP's own switch
    if reverse:
        ordered.reverse()
        order = order[::-1]
    assignment = dist._compute_bucket_assignment_by_size(ordered, limits, [False] * n, order)[0]
    if reverse:
        assignment = assignment[::-1]
    state.predicted = [list(piece) for piece in assignment]
    base = bucket.buffer().storage_offset()
    grads = list(bucket.gradients())
    return [
        [(grads[i].storage_offset() - base, grads[i].numel()) for i in piece]
        for piece in state.predicted
    ]


def _rebuild_limits(ddp: Any) -> list[int]:
    """The bucket size limits DDP's Reducer rebuilds with (torch 2.4 to 2.14): a small first
    bucket only when bucket_cap_mb was left to its default."""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:  # newer torch: one place holds them
        if config.per_bucket_bytes_caps:
            return list(config.per_bucket_bytes_caps)
        return [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    first = (
        dist._DEFAULT_FIRST_BUCKET_BYTES
        if getattr(ddp, "bucket_bytes_cap_default", False)
        else ddp.bucket_bytes_cap
    )
    return [first, ddp.bucket_bytes_cap]


def _rank0s(order: list[int], group: Any, device: torch.device) -> list[int]:
    """Rank 0's gradient-ready order (DDP's rebuild takes rank 0's too)."""
    if group is None or dist.get_world_size(group) == 1:
        return order
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    order_tensor = torch.tensor(order, dtype=torch.int64, device=on)
    dist.broadcast(order_tensor, src=dist.get_global_rank(group, 0), group=group)
    return [int(i) for i in order_tensor.tolist()]


def _check(state: LayoutState, bucket: Any) -> None:
    """At the first rebuilt step: is DDP's layout the one the first step was summed in?"""
    position = state.index_of
    state.checking[bucket.index()] = [position.get(id(p), -1) for p in bucket.parameters()]
    if not bucket.is_last():
        return
    actual = [state.checking[i] for i in sorted(state.checking)]
    predicted = state.predicted
    state.predicted, state.checking = None, {}
    if predicted is not None and actual != predicted:
        print(
            "ddpkit: DDP rebuilt its gradient buckets unlike the first step's layout "
            f"({len(actual)} buckets, {len(predicted)} predicted; torch {torch.__version__}): "
            "a run resumed from a checkpoint may differ from the never-stopped run in the last "
            "bits at 3 or more ranks. Please report it to ddpkit.",
            file=sys.stderr,
            flush=True,
        )
