"""Suite-wide guards: one thread per rank on a 2-core machine, gloo on loopback, and every test
fails if it leaves a child process running or a process group initialised."""

from __future__ import annotations

import os

import psutil
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
for leaked in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(leaked, None)


def _descendants() -> list[psutil.Process]:
    procs = psutil.Process().children(recursive=True)
    # multiprocessing's forkserver and resource tracker, and the compile-worker pool torch 2.4
    # starts in a process that calls torch.compile, live for the whole session by design; the
    # rank processes the forkserver forks do not
    helpers = ("forkserver", "resource_tracker", "_inductor/compile_worker")
    return [
        p
        for p in procs
        if not any(h in " ".join(_cmdline(p)) for h in helpers)
        and _status(p) != psutil.STATUS_ZOMBIE
    ]


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.Error:
        return psutil.STATUS_DEAD


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(autouse=True)
def fresh_rank_runtime():
    """Each test meets this process as a new rank would: one runtime (ddpkit.rank.runtime)
    holds every part's state and the optimizer-step hub, and resetting it is all it takes."""
    from ddpkit.rank import runtime

    runtime.reset()
    yield
    runtime.reset()


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    left = [p for p in _descendants() if p.is_running()]
    if left:
        gone, alive = psutil.wait_procs(left, timeout=3)
        # one that ended while we waited and awaits its parent's wait() has not been left behind
        alive = [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE]
        for p in alive:
            p.kill()
        assert not alive, f"processes left behind: {[(p.pid, _cmdline(p)) for p in alive]}"


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("the test left a process group initialised")


@pytest.fixture(autouse=True)
def cpu_seconds_per_test(request):
    """DDPKIT_TEST_CPU=FILE appends each test's CPU seconds (its own and its reaped
    descendants': the launchers and their ranks) to FILE: where the suite's time goes."""
    out = os.environ.get("DDPKIT_TEST_CPU")
    if not out:
        yield
        return
    import resource

    def cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    began = cpu()
    yield
    with open(out, "a") as f:
        f.write(f"{cpu() - began:.2f} {request.node.nodeid}\n")
