"""Run a function on N real gloo ranks, in processes from a forkserver with torch preloaded.

The parent holds the job's TCPStore on a free port (as `ddpkit run` does), each rank gets the
variables a launcher sets, calls `fn(rank, world_size, tmp, *args)` and writes its result (or its
traceback) to its own file. A rank that does not finish within the timeout fails the test, and
no rank process may outlive the call.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "ddpkit.train.session",
]
_ctx = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


class RankFailedError(AssertionError):
    pass


@dataclass(frozen=True)
class RankError:
    """What a rank raised, when the test expects it to."""

    type: str
    message: str


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    tmp: str,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            # torch 2.4 reads it whenever the agent store is used, as every launcher sets it
            "TORCHELASTIC_RESTART_COUNT": "0",
            "DDPKIT_BACKEND": "gloo",
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    # the rank's own stderr, kept for the failure message (pytest's capture would hide it)
    err_file = os.open(Path(tmp) / f"stderr{rank}.txt", os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(err_file, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks when a rank hangs
    out = Path(tmp) / f"result{rank}.pkl"
    try:
        result = ("ok", fn(rank, world, Path(tmp), *args))
    except BaseException as err:  # report every failure to the parent, typed
        result = ("error", (type(err).__name__, str(err), traceback.format_exc()))
    out.write_bytes(pickle.dumps(result))


def _stacks_of(hung: list[int], procs: list[Any], tmp: Path) -> str:
    """Where each hung rank is (its threads' stacks), and whether it had reported a result."""
    for r in hung:
        with contextlib.suppress(ProcessLookupError):  # it may have ended just now
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1)
    return "\n".join(
        f"rank {r} ({'after' if (tmp / f'result{r}.pkl').exists() else 'before'} reporting):\n"
        + (tmp / f"stderr{r}.txt").read_text()[-4000:]
        for r in hung
    )


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    tmp: Path,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    expect_errors: bool = False,
) -> list[Any]:
    """Results of fn on every rank, in rank order. With expect_errors, a rank's error comes
    back as a RankError instead of failing the test."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False
    )
    ctx = _context()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, store.port, str(tmp), args, env or {}))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    pids = [p.pid for p in procs]
    deadline = time.monotonic() + timeout  # one deadline for all: a hang is reported in time
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    stacks = _stacks_of(hung, procs, tmp)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    left = [
        pid
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert not left, f"rank processes survived: {left}"
    if hung:
        raise RankFailedError(f"ranks {hung} did not finish within {timeout} s\n{stacks}")
    results = []
    for r in range(world):
        result_file = tmp / f"result{r}.pkl"
        if not result_file.exists():
            stderr = (tmp / f"stderr{r}.txt").read_text()[-3000:]
            raise RankFailedError(
                f"rank {r} died (exit code {procs[r].exitcode}) before reporting:\n{stderr}"
            )
        with warnings.catch_warnings():
            # a pickled tensor loads through torch.load, which warns about weights_only on
            # torch 2.4 (the ranks' own results, written by this harness)
            warnings.simplefilter("ignore", FutureWarning)
            status, value = pickle.loads(result_file.read_bytes())
        if status == "error" and not expect_errors:
            raise RankFailedError(f"rank {r} raised {value[0]}: {value[1]}\n{value[2]}")
        results.append(RankError(*value[:2]) if status == "error" else value)
    return results
