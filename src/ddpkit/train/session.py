"""`ddpkit.setup()`: join the job (or run alone), and the helpers that make one script run on
CPU, one GPU or many.

setup() reads the environment (`ddpkit.env`), picks the backend (nccl when each local rank has a
GPU of its own, else gloo) and the device (from the LOCAL rank), sets the device before init,
waits for every peer with a bounded timeout that names who is missing, and inits eagerly where
torch can. With no launcher variables it runs as one process and never blocks. The process
group is destroyed by `close()`, on leaving a `with` block, or at exit.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.common import protocol
from ddpkit.env import DistEnv, read_env
from ddpkit.errors import ConfigError, install_excepthook
from ddpkit.train import bucket_layout, checkpoint, comm, joining, loaders, sharding, state
from ddpkit.train.graphs import ASYNC_VARIABLE, capture
from ddpkit.train.seeding import seed_everything
from ddpkit.train.stopping import StopFlag
from ddpkit.train.training import Precision
from ddpkit.train.wrapping import WRAP_DEFAULTS, buffers_are_batchnorm_statistics, unwrap


@dataclass
class Step:
    """One micro-step inside `Session.accumulate`: `sync` is True on the step that should
    call optimizer.step()."""

    index: int
    sync: bool


class Session:
    """This process's place in the job and the helpers that depend on it."""

    def __init__(
        self,
        env: DistEnv,
        backend: str,
        device: torch.device,
        seed: int,
        owns_group: bool,
        precision: Precision | None = None,
    ) -> None:
        self.env = env
        self.backend = backend
        self.device = device
        self.seed = seed
        self._owns_group = owns_group
        self._micro_steps: dict[int, int] = {}
        self._stop = StopFlag()
        self._graphs = False  # setup(graphs=True): models wrapped for s.graph
        self._graph_steps: list[weakref.ref[Any]] = []
        self._precision = precision or Precision(device)
        atexit.register(self.close)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

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
        has more than one process (device_ids = this LOCAL rank on GPU), with WRAP_DEFAULTS
        unless given. compress="bf16"|"fp16" all-reduces gradients in half precision (for
        slow links: half the bytes, some precision lost); compile=True applies torch.compile
        to the result. shard=True (or a list of block classes, or a callable) shards the
        model with FSDP2 instead of DDP (ddpkit.train.sharding)."""
        if shard is not False and shard is not None:
            return self._shard(model, shard, compress, compile, ddp_kwargs)
        if compress not in (None, "bf16", "fp16"):
            raise ConfigError(
                f"wrap(compress={compress!r}) is not 'bf16', 'fp16' or None",
                fix="use compress='bf16' for slow links, or leave it out",
            )
        if compress == "bf16" and self.world_size > 1 and self.backend != "nccl":
            raise ConfigError(
                f"wrap(compress='bf16') needs the nccl backend; this job uses {self.backend}",
                fix="use compress='fp16' on gloo, or run on GPUs with NCCL",
            )
        model = model.to(self.device)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            for option, value in WRAP_DEFAULTS.items():
                ddp_kwargs.setdefault(option, value)
            if buffers_are_batchnorm_statistics(model):
                ddp_kwargs.setdefault("broadcast_buffers", False)
            if self.device.type == "cuda":
                ddp_kwargs.setdefault("device_ids", [self.device.index])
                ddp_kwargs.setdefault("output_device", self.device.index)
            if self.device.type == "cuda" and self._graphs:
                # built on a side stream, as a CUDA graph of the step needs (s.graph; the
                # capture fails without it). Only then: eager steps on the default stream
                # would make autograd warn about the streams not matching.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    model = DistributedDataParallel(model, **ddp_kwargs)
                torch.cuda.current_stream().wait_stream(side)
            else:
                model = DistributedDataParallel(model, **ddp_kwargs)
            hook = None
            if compress is not None:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                hook = getattr(default_hooks, f"{compress}_compress_hook")
            if self._graphs:  # a captured step keeps DDP's buckets of its capture
                if hook is not None:
                    model.register_comm_hook(dist.group.WORLD, hook)
            else:  # the first step sums as every later one: exact resume (bucket_layout)
                bucket_layout.install(model, inner=hook)
        return torch.compile(model) if compile else model

    def _shard(
        self,
        model: nn.Module,
        choice: sharding.Choice,
        compress: str | None,
        compile: bool,
        ddp_kwargs: dict[str, Any],
    ) -> nn.Module:
        if compress is not None or ddp_kwargs:
            given = ", ".join([*(["compress"] if compress else []), *ddp_kwargs])
            raise ConfigError(
                f"s.wrap(shard=...) takes no DDP options ({given})",
                fix="leave them out: a sharded model reduces gradients with FSDP2's own "
                "reduce-scatter (in fp32 under bf16 precision)",
            )
        if self._graphs:
            raise ConfigError(
                "s.wrap(shard=True) with setup(graphs=True): FSDP2's hooks all-gather and free "
                "parameters on the host, which a captured CUDA graph cannot replay",
                fix="run sharded steps eagerly: leave graphs=True out",
            )
        sharding.check_torch(self.backend)
        model = model.to(self.device)
        if self.world_size > 1:
            sharding.shard(model, choice, self.device, self._precision.precision, self.world_size)
        return torch.compile(model) if compile else model

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Collective: the model's whole state dict on rank 0, on the CPU, plain tensors
        (`torch.save`-loadable, no ddpkit needed to read it); {} on the other ranks. For a
        sharded model the shards are gathered; for others it is the unwrapped state_dict."""
        inner = unwrap(model)
        if sharding.is_sharded(inner):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            found = get_model_state_dict(inner, options=options)
            return dict(found) if self.is_main else {}
        if not self.is_main:
            return {}
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()}

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, every: int) -> Iterator[Step]:
        """One micro-step of gradient accumulation: gradients are synchronised only on every
        `every`-th call (step.sync is True then); the others run under DDP's no_sync."""
        if every < 1:
            raise ConfigError(
                f"accumulate(every={every}) must be at least 1",
                fix="pass every=1 for no accumulation, or the micro-step count",
            )
        count = self._micro_steps.get(id(model), 0) + 1
        self._micro_steps[id(model)] = count
        step = Step(index=count, sync=count % every == 0)
        inner = unwrap(model)
        if sharding.is_sharded(inner):  # FSDP2: no no_sync(), a switch on the module
            inner.set_requires_gradient_sync(step.sync)  # type: ignore[operator]
            yield step
            return
        no_sync = getattr(model, "no_sync", None)
        if step.sync or no_sync is None:
            yield step
        else:
            with no_sync():
                yield step

    # -- data ----------------------------------------------------------------------------

    def loader(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        eval: bool = False,
        to_device: bool = False,
        seeded: bool = True,
        **dataloader_kwargs: Any,
    ) -> loaders.EpochLoader:
        """This rank's share of `dataset` (see ddpkit.train.loaders.make_loader): resumable with
        save_state/load_state; to_device=True moves each batch to s.device; seeded=False leaves
        the randomness of Dataset.__getitem__ alone."""
        return loaders.make_loader(
            dataset,
            batch_size,
            self.rank,
            self.world_size,
            self.seed,
            shuffle=shuffle,
            eval=eval,
            to_device=self.device if to_device else None,
            seeded=seeded,
            **dataloader_kwargs,
        )

    # -- stop and resume -----------------------------------------------------------------

    def save_state(self, path: str | os.PathLike[str], keep: int = 2, **objects: Any) -> None:
        """Collective: every object's state (modules, optimizers, schedulers, scalers,
        s.loader positions, dicts) and every rank's RNG, atomically (ddpkit.train.state)."""
        state.save_state(path, objects, self.rank, self.world_size, keep=keep)

    def load_state(self, path: str | os.PathLike[str], rng: bool = True, **objects: Any) -> bool:
        """Collective: restore the newest complete state into `objects`, in place; False when
        `path` holds none (a first run)."""
        return state.load_state(path, objects, self.rank, self.world_size, self.device, rng=rng)

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
        model and optimizer(s) so their state before the warm-up is put back (ddpkit.train.graphs).
        On the CPU or gloo the step runs eagerly."""
        models = [model] if isinstance(model, nn.Module) else list(model)
        optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        if any(sharding.is_sharded(unwrap(m)) for m in models):
            raise ConfigError(
                "s.graph cannot capture a sharded model's step: FSDP2 gathers and frees "
                "parameters from the host around every unit, which a CUDA graph cannot replay",
                fix="call the step eagerly (without s.graph); graphed steps are for DDP models",
            )
        graphed = capture(
            step,
            inputs,
            optimizers,
            models,
            self.device,
            self.backend,
            self.world_size,
            warmup,
        )
        self._graph_steps.append(weakref.ref(graphed))
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
        return comm.reduce(value, self._comm_device, op)

    def gather(self, value: Any) -> list[Any]:
        return comm.gather(value, self._comm_device)

    def barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. to download or build a cache), then the rest."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

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
        error = None
        if sharding.has_dtensors(obj):  # a sharded state_dict(): every rank gives its shards
            obj = sharding.full_tensors(obj)
        if self.is_main:
            try:
                checkpoint.write_atomic(obj, path)
            except Exception as err:  # torch.save says ENOSPC as a RuntimeError
                error = f"{path}: {checkpoint.why(err)}"
        if self.world_size > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0, device=self._comm_device)
            error = box[0]
        if error is not None:
            from ddpkit.errors import CheckpointError

            raise CheckpointError(
                f"rank 0 could not write the checkpoint {error}",
                fix="check free space and permissions of that folder",
            )

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> Any:
        """Read a checkpoint onto this rank's device (weights_only=True by default)."""
        return checkpoint.read(path, self.device, weights_only=weights_only)

    # -- lifetime ------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """Destroy the process group this session created (safe to call twice). After a
        failure the peers are not expected at a barrier, so gloo is not drained."""
        failed = failed or getattr(sys, "last_value", None) is not None  # uncaught error
        graphed = self._release_graphs()
        if dist.is_initialized():
            self._stop.close(failed)
        if self._owns_group and dist.is_initialized():
            if self.backend == "gloo" and self.world_size > 1 and not failed:
                joining.drain_gloo()
            elif self.backend == "gloo" and self.world_size > 1:
                joining.settle_gloo()  # the peers may be gone: no barrier, but no deadlock
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            # destroy waits for NCCL work that peers will never finish, and for communicators
            # a CUDA graph captured (measured: it never returned): abort does not
            ends_hard = failed or graphed
            if ends_hard and self.backend == "nccl" and self.world_size > 1 and abort is not None:
                # destroy waits for NCCL work that peers will never finish; abort does not
                abort()
            else:
                dist.destroy_process_group()
        self._owns_group = False

    def _release_graphs(self) -> bool:
        """Free every graph s.graph captured (they hold NCCL work); True if there were any."""
        steps = [ref() for ref in self._graph_steps]
        self._graph_steps = []
        for step in steps:
            if step is not None:
                step.release()
        return any(step is not None for step in steps)

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
    install_excepthook()
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
    seed_value = 0 if seed is None else seed
    if seed is not None:
        seed_everything(seed)
    backend, device = joining.choose(env, backend)
    amp = Precision(device, precision)  # a bad precision is an error before anyone waits
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds to the current device
    if dist.is_initialized():  # the script (or a framework) already joined: adopt it
        return Session(env, dist.get_backend(), device, seed_value, False, amp)
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
    store = joining.rendezvous(env, init_timeout)
    kwargs: dict[str, Any] = {}
    if group_timeout is not None:
        kwargs["timeout"] = group_timeout
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: errors surface here, not at step 1
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, **kwargs
    )
    session = Session(env, backend, device, seed_value, True, amp)
    session._graphs = graphs
    return session
