"""How a process joins the job: which backend and device, the bounded wait for every peer,
and the input checks of `setup()` (a bad backend or timeout is a ConfigError before anything
waits). Used by `ddpkit.train.session.setup`."""

from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.common import protocol
from ddpkit.env import DistEnv, check_gpu_fit
from ddpkit.errors import ConfigError, EnvError
from ddpkit.train.placement import Placement

BACKENDS = ("auto", "nccl", "gloo")
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: longer is a typo, and torch's timers overflow on inf
DEFAULT_INIT_TIMEOUT = 300.0


def requested_backend(backend: object) -> str:
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


def group_timeout(timeout: object) -> timedelta | None:
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


def seconds_from_env(names: tuple[str, ...], default: float) -> float:
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


def drain_gloo(timeout: float = 10.0) -> None:
    """Let gloo's worker threads finish with their last collectives before the group goes.

    A finished gloo work is freed on gloo's own thread, which must take the GIL to release a
    tensor Python made. Destroying the group joins those threads while the main thread holds
    the GIL: if one is still freeing a work, neither moves (seen with gdb on torch 2.4: the
    worker in ~AsyncAllgatherWork waiting for the GIL, the main thread in ~ProcessGroupGloo),
    or the interpreter aborts ("terminate called without an active exception"; 2 of 16
    two-rank DDP runs under torchrun and ddpkit alike, torch 2.13). A bounded barrier waits
    with the GIL released, so the collectives end everywhere; a peer that is gone costs at
    most `timeout` seconds, never a hang. Then `settle_gloo`.
    """
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout))
    except RuntimeError:
        pass
    settle_gloo()


GLOO_SETTLE_S = 0.1


def settle_gloo() -> None:
    """Hold no GIL for a moment, so that a gloo thread still freeing a finished work (which
    it does after the work reports done, and later when the machine is loaded) takes it and
    ends before the group's destructor joins it."""
    time.sleep(GLOO_SETTLE_S)


def choose(env: DistEnv, backend: str) -> tuple[str, torch.device]:
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


def leave(place: Placement, failed: bool, graphed: bool) -> None:
    """Destroy the process group this process created. After a failure the peers are not
    expected at a barrier, so gloo is not drained; NCCL is aborted where destroying would wait
    for work peers will never finish, or for communicators a CUDA graph captured (measured:
    destroy never returned)."""
    if not dist.is_initialized():
        return
    if place.backend == "gloo" and not place.alone and not failed:
        drain_gloo()
    elif place.backend == "gloo" and not place.alone:
        settle_gloo()  # the peers may be gone: no barrier, but no deadlock
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    ends_hard = failed or graphed
    if ends_hard and place.backend == "nccl" and not place.alone and abort is not None:
        abort()
    else:
        dist.destroy_process_group()
