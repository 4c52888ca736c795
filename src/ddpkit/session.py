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
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit import checkpoint, comm, loaders, protocol
from ddpkit.env import DistEnv, check_gpu_fit, read_env
from ddpkit.errors import ConfigError, EnvError, InitTimeoutError, install_excepthook
from ddpkit.ranges import ranks_text
from ddpkit.seeding import seed_everything

DEFAULT_INIT_TIMEOUT = 300.0
# DDP options s.wrap sets unless given, each from benchmarks/RESULTS.md (2 H200s, GPT-2-small
# shape, bf16): bigger buckets cut step time 6.9% (fewer, fuller NCCL calls); gradients as
# views of the buckets save a copy and a gradient's worth of memory (1.1%); 50-400 MB buckets
# tie, 25 MB (torch's) is 3-6% slower. static_graph gained nothing and is unsafe for models
# whose graph changes, so it stays off. broadcast_buffers=False is added only for models whose
# buffers are all BatchNorm statistics (-9.5% on a ResNet-50 shape; docs/bench-ddp.md).
WRAP_DEFAULTS = {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}
BACKENDS = ("auto", "nccl", "gloo")
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: longer is a typo, and torch's timers overflow on inf


@dataclass
class Step:
    """One micro-step inside `Session.accumulate`: `sync` is True on the step that should
    call optimizer.step()."""

    index: int
    sync: bool


def _buffers_are_batchnorm_statistics(model: nn.Module) -> bool:
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


class Session:
    """This process's place in the job and the helpers that depend on it."""

    def __init__(
        self, env: DistEnv, backend: str, device: torch.device, seed: int, owns_group: bool
    ) -> None:
        self.env = env
        self.backend = backend
        self.device = device
        self.seed = seed
        self._owns_group = owns_group
        self._micro_steps: dict[int, int] = {}
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
        **ddp_kwargs: Any,
    ) -> nn.Module:
        """Move `model` to this rank's device; wrap it in DistributedDataParallel when the job
        has more than one process (device_ids = this LOCAL rank on GPU), with WRAP_DEFAULTS
        unless given. compress="bf16"|"fp16" all-reduces gradients in half precision (for
        slow links: half the bytes, some precision lost); compile=True applies torch.compile
        to the result."""
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
            if _buffers_are_batchnorm_statistics(model):
                ddp_kwargs.setdefault("broadcast_buffers", False)
            if self.device.type == "cuda":
                ddp_kwargs.setdefault("device_ids", [self.device.index])
                ddp_kwargs.setdefault("output_device", self.device.index)
            model = DistributedDataParallel(model, **ddp_kwargs)
            if compress is not None:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                hook = getattr(default_hooks, f"{compress}_compress_hook")
                model.register_comm_hook(dist.group.WORLD, hook)
        return torch.compile(model) if compile else model

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
        **dataloader_kwargs: Any,
    ) -> torch.utils.data.DataLoader:  # noqa: A002
        """This rank's share of `dataset` (see ddpkit.loaders.make_loader)."""
        return loaders.make_loader(
            dataset,
            batch_size,
            self.rank,
            self.world_size,
            self.seed,
            shuffle=shuffle,
            eval=eval,
            **dataloader_kwargs,
        )

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
        from tqdm.auto import tqdm

        return tqdm(iterable, **tqdm_kwargs)

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Collective: rank 0 writes `obj` atomically; every rank returns once it is on disk
        (or every rank raises if writing failed)."""
        error = None
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
        if self._owns_group and dist.is_initialized():
            if self.backend == "gloo" and self.world_size > 1 and not failed:
                _drain_gloo()
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if failed and self.backend == "nccl" and self.world_size > 1 and abort is not None:
                # destroy waits for NCCL work that peers will never finish; abort does not
                abort()
            else:
                dist.destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: object
    ) -> None:
        ended_well = kind is None or (isinstance(value, SystemExit) and value.code in (None, 0))
        self.close(failed=not ended_well)


def setup(
    backend: str = "auto", timeout: float | timedelta | None = None, seed: int | None = None
) -> Session:
    """Join the job started by a launcher (ddpkit run, torchrun, srun, mpirun), or run as a
    single process when there is none. `timeout` bounds init (peers must arrive within it) and
    is the process group's collective timeout; default: 300 s for init
    (DDPKIT_INIT_TIMEOUT), torch's default for collectives."""
    install_excepthook()
    backend = _requested_backend(backend)
    group_timeout = _group_timeout(timeout)
    init_timeout = (
        group_timeout.total_seconds()
        if group_timeout is not None
        else _seconds_from_env((protocol.INIT_TIMEOUT, "DDPKIT_INIT_TIMEOUT"), DEFAULT_INIT_TIMEOUT)
    )
    env = read_env()
    seed_value = 0 if seed is None else seed
    if seed is not None:
        seed_everything(seed)
    backend, device = _choose(env, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds to the current device
    if dist.is_initialized():  # the script (or a framework) already joined: adopt it
        return Session(env, dist.get_backend(), device, seed_value, owns_group=False)
    if env.launcher == "none":
        print(
            "ddpkit: no launcher variables found; running as a single process "
            "(to use N GPUs: ddpkit run -n N script.py)",
            file=sys.stderr,
            flush=True,
        )
    store = _rendezvous(env, init_timeout)
    kwargs: dict[str, Any] = {}
    if group_timeout is not None:
        kwargs["timeout"] = group_timeout
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: errors surface here, not at step 1
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, **kwargs
    )
    return Session(env, backend, device, seed_value, owns_group=True)


def _requested_backend(backend: object) -> str:
    """The backend asked for: the script's argument, or with "auto" what `ddpkit run` decided
    (CPU processes: gloo) or DDPKIT_BACKEND says; "auto" when nobody said."""
    sources = [("setup(backend=...)", backend)]
    if backend == "auto":
        sources += [(var, os.environ.get(var, "")) for var in (protocol.BACKEND, "DDPKIT_BACKEND")]
    for name, value in sources:
        if not isinstance(value, str):
            raise ConfigError(
                f"{name} is {value!r}, not one of {BACKENDS}",
                fix="use 'auto' (nccl with one GPU per rank, else gloo)",
            )
        word = value.strip().lower()
        if word and word not in BACKENDS:
            where = name if name.startswith("setup") else f"{name}={value!r}"
            raise ConfigError(
                f"{where} is not one of {', '.join(BACKENDS)}",
                fix="use auto (nccl with one GPU per rank, else gloo), nccl or gloo",
            )
        if word and word != "auto":
            return word
    return "auto"


def _group_timeout(timeout: object) -> timedelta | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigError(
            f"setup(timeout={timeout!r}) is not a number of seconds",
            fix="pass seconds as a number, e.g. setup(timeout=600), or a timedelta",
        )
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_TIMEOUT:
        raise ConfigError(
            f"setup(timeout={timeout!r}) must be more than 0 and at most {MAX_TIMEOUT:.0f} s",
            fix="pass the seconds init and collectives may wait, e.g. setup(timeout=600)",
        )
    return timedelta(seconds=seconds)


def _seconds_from_env(names: tuple[str, ...], default: float) -> float:
    for name in names:
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_TIMEOUT:
            raise ConfigError(
                f"{name}={raw!r} is not a number of seconds between 0 and {MAX_TIMEOUT:.0f}",
                fix=f"set {name} to the seconds init may wait (e.g. 300), or unset it",
            )
        return seconds
    return default


def _drain_gloo(timeout: float = 10.0) -> None:
    """Let gloo's worker threads finish with their last collectives before the group goes.

    A finished gloo work is freed on gloo's own thread, which must take the GIL to release a
    Python object it captured. If the main thread destroys the group (or the interpreter shuts
    down) first, that thread deadlocks or aborts the process ("terminate called without an
    active exception"; seen in 2 of 16 two-rank DDP runs under torchrun and ddpkit alike, torch
    2.13). A bounded barrier waits with the GIL released, so they finish; a peer that is gone
    costs at most `timeout` seconds, never a hang.
    """
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout))
    except RuntimeError:
        pass


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


def _choose(env: DistEnv, backend: str) -> tuple[str, torch.device]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        own_gpu = gpus >= env.local_world_size and dist.is_nccl_available()
        if gpus and not own_gpu:
            print(
                f"ddpkit: {env.local_world_size} processes on this node but {gpus} GPU(s): "
                "using gloo on the CPU",
                file=sys.stderr,
                flush=True,
            )
        backend = "nccl" if own_gpu and gpus else "gloo"
    if backend == "nccl":
        if not gpus:
            raise EnvError(
                "backend='nccl' needs a CUDA GPU, and none is visible",
                fix="use backend='auto' or 'gloo' on CPU-only machines",
            )
        check_gpu_fit(env, gpus)
        return "nccl", torch.device("cuda", env.local_rank)
    return "gloo", torch.device("cpu")


def _rendezvous(env: DistEnv, init_timeout: float) -> dist.Store:
    """A store every rank shares, after every rank has arrived (or an error naming who did
    not, within init_timeout)."""
    if env.world_size == 1 and env.launcher == "none":
        return dist.HashStore()
    state_dir = os.environ.get(protocol.STATE_DIR)
    if state_dir:  # the launcher's init watch starts now: it names who never arrives
        with contextlib.suppress(OSError):
            protocol.write_phase(state_dir, env.rank, "init")
    # Under ddpkit run / torchrun the launcher holds the store; otherwise rank 0 does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_server = env.rank == 0 and not agent_store
    started = time.monotonic()
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_server,
            timeout=timedelta(seconds=init_timeout),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, dist.DistNetworkError) as err:
        where = f"{env.master_addr}:{env.master_port}"
        if is_server:
            raise InitTimeoutError(
                f"rank 0 could not listen on {where}: {err}",
                fix="MASTER_PORT is probably in use: pick another, or let `ddpkit run` "
                "choose a free one",
            ) from err
        raise InitTimeoutError(
            f"rank {env.rank} could not reach rank 0 at {where} within {init_timeout:.0f} s",
            fix="start every rank (ddpkit run does), and check MASTER_ADDR/MASTER_PORT",
        ) from err
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"ddpkit/arrive/{attempt}/"
    store.set(f"{prefix}{env.rank}", "1")
    if store.add(f"{prefix}count", 1) == env.world_size:
        store.set(f"{prefix}all", "1")  # the last to arrive tells the others: no polling
    left = max(0.0, started + init_timeout - time.monotonic())
    try:
        store.wait([f"{prefix}all"], timedelta(seconds=left))
    except (RuntimeError, dist.DistError):
        missing = [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]
        arrived = env.world_size - len(missing)
        raise InitTimeoutError(
            f"{arrived} of {env.world_size} ranks arrived at init within "
            f"{init_timeout:.0f} s; missing: rank {ranks_text(missing)}",
            fix="start every rank with the same WORLD_SIZE (ddpkit run does), or look at "
            "why the missing ranks stopped before setup()",
        ) from None
    return dist.PrefixStore(f"ddpkit/pg/{attempt}", store)
