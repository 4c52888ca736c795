"""`ddpkit.setup()`: join the job (or run alone), and the session whose helpers make one script
run on CPU, one GPU or many.

setup() reads the environment (`ddpkit.env`), picks the backend (nccl when each local rank has a
GPU of its own, else gloo) and the device (from the LOCAL rank), sets the device before init,
waits for every peer with a bounded timeout that names who is missing, and inits eagerly where
torch can. With no launcher variables it runs as one process and never blocks. The process
group is destroyed by `close()`, on leaving a `with` block, or at exit.

The session is a facade: each method is a few lines over the module that does the work, and
passes it this process's frozen `Placement` (rank, world size, backend, device, seed).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.common import protocol
from ddpkit.env import DistEnv, read_env
from ddpkit.errors import ConfigError, install_excepthook
from ddpkit.train import (
    arrival,
    checkpoint,
    comm,
    fitting,
    joining,
    loaders,
    rescue,
    sharding,
    state,
    step_count,
)
from ddpkit.train.graphs import ASYNC_VARIABLE, Captured, capture
from ddpkit.train.placement import Placement
from ddpkit.train.seeding import seed_everything
from ddpkit.train.stopping import StopFlag
from ddpkit.train.training import MicroSteps, Precision, Step
from ddpkit.train.wrapping import unwrap, wrap_ddp

__all__ = ["Session", "Step", "setup"]


class Session:
    """This process's place in the job and the helpers that depend on it."""

    def __init__(
        self,
        env: DistEnv,
        place: Placement,
        owns_group: bool,
        precision: Precision | None = None,
        graphs: bool = False,
    ) -> None:
        self.env = env
        self.place = place
        self._owns_group = owns_group
        self._micro_steps = MicroSteps()
        self._stop = StopFlag()
        self._graphs = graphs  # setup(graphs=True): models wrapped for s.graph
        self._captured = Captured()
        self._precision = precision or Precision(place.device)
        step_count.install()  # the job's step count, kept in its states across restarts
        atexit.register(self.close)

    rank = property(lambda self: self.place.rank)
    local_rank = property(lambda self: self.place.local_rank)
    world_size = property(lambda self: self.place.world_size)
    backend = property(lambda self: self.place.backend)
    device = property(lambda self: self.place.device)
    seed = property(lambda self: self.place.seed)
    is_main = property(lambda self: self.place.is_main)

    def __repr__(self) -> str:
        return (
            f"Session(rank={self.rank}, local_rank={self.local_rank}, world_size="
            f"{self.world_size}, backend={self.backend!r}, device={str(self.device)!r})"
        )

    # -- model ---------------------------------------------------------------------------

    def wrap(
        self,
        model: nn.Module,
        compress: str | None = None,
        compile: bool = False,
        shard: sharding.Choice = False,
        **ddp_kwargs: Any,
    ) -> nn.Module:
        """Move `model` to this rank's device; wrap it in DistributedDataParallel when the job
        has more than one process (device_ids = this LOCAL rank on GPU), with s.wrap's
        defaults unless given (ddpkit.train.wrapping). compress="bf16"|"fp16" all-reduces
        gradients in half precision (for slow links: half the bytes, some precision lost);
        compile=True applies torch.compile to the result. shard=True (or a list of block
        classes, or a callable) shards the model with FSDP2 instead of DDP
        (ddpkit.train.sharding)."""
        if shard is not False and shard is not None:
            wrapped = sharding.shard_for_session(
                model, shard, self.place, self._precision.precision, self._graphs, compress,
                ddp_kwargs,
            )  # fmt: skip
        else:
            wrapped = wrap_ddp(model, self.place, self._graphs, compress, **ddp_kwargs)
        return cast(nn.Module, torch.compile(wrapped)) if compile else wrapped

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Collective: the model's whole state dict on rank 0, on the CPU, plain tensors
        (`torch.save`-loadable, no ddpkit needed to read it); {} on the other ranks."""
        return sharding.full_state_dict(model, self.place)

    def accumulate(self, model: nn.Module, every: int) -> contextlib.AbstractContextManager[Step]:
        """One micro-step of gradient accumulation: gradients are synchronised only on every
        `every`-th call (step.sync is True then); the others run under DDP's no_sync."""
        return self._micro_steps.step(model, every)

    def fit(self, model: nn.Module, optimizer: Any, micro_batch: int | None = None) -> fitting.Fit:
        """A batch that fits, agreed across ranks (ddpkit.train.fitting): `fit.step(loss_fn,
        x, y)` runs the batch in micro-batches and, when any rank runs out of memory, every
        rank halves the micro-batch (keeping the batch) and does the step again."""
        return fitting.Fit(model, optimizer, self.place, micro_batch)

    # -- data ----------------------------------------------------------------------------

    def loader(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        eval: bool = False,
        to_device: bool = False,
        seeded: bool = True,
        keep_batch: str = "global",
        **dataloader_kwargs: Any,
    ) -> loaders.EpochLoader:
        """This rank's share of `dataset` (ddpkit.train.loaders.make_loader): resumable with
        save_state/load_state, at another world size too (ddpkit.train.dealing); to_device=True
        moves each batch to s.device; seeded=False leaves the randomness of
        Dataset.__getitem__ alone; keep_batch ('global' or 'per_rank') says what a resume at
        another world size keeps."""
        return loaders.make_loader(
            dataset, batch_size, self.place, shuffle, eval, to_device, seeded, keep_batch,
            **dataloader_kwargs,
        )  # fmt: skip

    # -- stop and resume -----------------------------------------------------------------

    def save_state(self, path: str | os.PathLike[str], keep: int = 2, **objects: Any) -> None:
        """Collective: every object's state (modules, optimizers, schedulers, scalers,
        s.loader positions, dicts) and every rank's RNG, atomically (ddpkit.train.state)."""
        state.save_state(path, objects, self.place, keep=keep)
        rescue.remember(path, objects, self.place)  # what a peer's failure keeps

    def load_state(self, path: str | os.PathLike[str], rng: bool = True, **objects: Any) -> bool:
        """Collective: restore the newest complete state into `objects`, in place; False when
        `path` holds none (a first run)."""
        loaded = state.load_state(path, objects, self.place, rng=rng)
        rescue.remember(path, objects, self.place)
        return loaded

    @property
    def stop_requested(self) -> bool:
        """True on every rank once any rank got SIGTERM, SIGINT or SIGUSR1 (reading it the
        first time makes those signals set it instead of ending the script)."""
        return self._stop.agreed(self.world_size)

    # -- graphed steps -------------------------------------------------------------------

    def graph(
        self,
        step: Callable[..., Any],
        *inputs: Any,
        model: nn.Module | Sequence[nn.Module] = (),
        optimizer: Any = (),
        warmup: int = 12,
    ) -> Callable[..., Any]:
        """`step(*inputs)` (forward, backward, optimizer step) captured as a CUDA graph after
        `warmup` eager steps; call the result with new inputs of the same shapes. Pass the
        model and optimizer(s) so their state before the warm-up is put back
        (ddpkit.train.graphs). On the CPU or gloo the step runs eagerly."""
        models = [model] if isinstance(model, nn.Module) else list(model)
        optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        if any(sharding.is_sharded(unwrap(m)) for m in models):
            raise ConfigError(
                "s.graph cannot capture a sharded model's step: FSDP2 gathers and frees "
                "parameters from the host around every unit, which a CUDA graph cannot replay",
                fix="call the step eagerly (without s.graph); graphed steps are for DDP models",
            )
        graphed = capture(step, inputs, optimizers, models, self.place, warmup)
        self._captured.add(graphed)
        return graphed

    # -- precision -----------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Mixed precision for the forward pass: bf16 on GPUs, off on CPU (setup(precision=))."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._precision.backward(loss, **kwargs)

    def step(self, optimizer: Any) -> None:
        """optimizer.step(), through the GradScaler with fp16."""
        self._precision.step(optimizer)

    def clip(self, model: nn.Module, max_norm: float, optimizer: Any = None) -> torch.Tensor:
        """Clip gradients to a global norm (unscaled first with fp16: pass the optimizer); the
        norm before clipping is returned, over every rank's shard for a sharded model."""
        norm = self._precision.clip(model, max_norm, optimizer)
        full = getattr(norm, "full_tensor", None)  # a DTensor: the norm of sharded gradients
        return full() if callable(full) else norm

    # -- collectives ---------------------------------------------------------------------

    def reduce(self, value: Any, op: str = "mean") -> Any:
        return comm.reduce(value, self.place, op)

    def gather(self, value: Any) -> list[Any]:
        return comm.gather(value, self.place)

    def barrier(self) -> None:
        comm.barrier(self.place)

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. to download or build a cache), then the rest."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    # -- output --------------------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on global rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            builtins.print(*args, **kwargs)

    def progress(self, iterable: Iterable[Any], **tqdm_kwargs: Any) -> Iterable[Any]:
        """A tqdm progress bar on global rank 0; the bare iterable elsewhere."""
        if not self.is_main:
            return iterable
        from tqdm import tqdm  # not tqdm.auto: its asyncio flavour iterates once more

        return tqdm(iterable, **tqdm_kwargs)

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Collective: rank 0 writes `obj` atomically; every rank returns once it is on disk
        (or every rank raises if writing failed)."""
        checkpoint.save(obj, path, self.place)

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> Any:
        """Read a checkpoint onto this rank's device (weights_only=True by default)."""
        return checkpoint.read(path, self.device, weights_only=weights_only)

    # -- lifetime ------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """Destroy the process group this session created (safe to call twice)."""
        failed = failed or getattr(sys, "last_value", None) is not None  # uncaught error
        graphed = self._captured.release()
        if dist.is_initialized():
            self._stop.close(failed)
        if self._owns_group:
            joining.leave(self.place, failed, graphed)
        self._owns_group = False

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: object
    ) -> None:
        ended_well = kind is None or (isinstance(value, SystemExit) and value.code in (None, 0))
        self.close(failed=not ended_well)


def setup(
    backend: str = "auto",
    timeout: float | timedelta | None = None,
    seed: int | None = None,
    precision: str = "auto",
    graphs: bool = False,
) -> Session:
    """Join the job started by a launcher (ddpkit run, torchrun, srun, mpirun), or run as a
    single process when there is none. `timeout` bounds init (peers must arrive within it) and
    is the process group's collective timeout; default: 300 s for init
    (DDPKIT_INIT_TIMEOUT), torch's default for collectives."""
    from ddpkit.rank.hints import fix_for

    install_excepthook(fix_for)
    backend = joining.requested_backend(backend)
    group_timeout = joining.group_timeout(timeout)
    init_timeout = (
        group_timeout.total_seconds()
        if group_timeout is not None
        else joining.seconds_from_env(
            (protocol.INIT_TIMEOUT, "DDPKIT_INIT_TIMEOUT"), joining.DEFAULT_INIT_TIMEOUT
        )
    )
    env = read_env()
    if seed is not None:
        seed_everything(seed)
    backend, device = joining.choose(env, backend)
    amp = Precision(device, precision)  # a bad precision is an error before anyone waits
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds to the current device

    def place(chosen: str) -> Placement:
        return Placement(env.rank, env.local_rank, env.world_size, chosen, device, seed or 0)

    if dist.is_initialized():  # the script (or a framework) already joined: adopt it
        return Session(env, place(dist.get_backend()), False, amp, graphs)
    if env.launcher == "none":
        print(
            "ddpkit: no launcher variables found; running as a single process "
            "(to use N GPUs: ddpkit run -n N script.py)",
            file=sys.stderr,
            flush=True,
        )
    if graphs:
        # s.graph with DDP: PyTorch's CUDA-graphs notes want NCCL's async error handling off
        os.environ.setdefault(ASYNC_VARIABLE, "0")
    store = arrival.rendezvous(env, init_timeout)
    kwargs: dict[str, Any] = {}
    if group_timeout is not None:
        kwargs["timeout"] = group_timeout
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: errors surface here, not at step 1
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, **kwargs
    )
    return Session(env, place(backend), True, amp, graphs)
