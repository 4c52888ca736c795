"""A launch inside a launch, refused before it starts: a script written for `mp.spawn` (PyTorch's
DDP tutorial: `mp.spawn(main, nprocs=world_size)` with its own MASTER_PORT) started by `ddpkit
run -n N` makes every rank start a world of its own. The worlds then clash on the script's port
(read as "address already in use", whose fix fails the same way) or wait for each other.

Installed by the bootstrap when torch.multiprocessing.spawn is imported; it acts only in a rank
(not its children) that has no process group yet, which is the double launch's shape. A rank
that already joined the job and spawns helpers of its own is left alone.
"""

from __future__ import annotations

import os
import sys
from types import FrameType, ModuleType
from typing import Any

from ddpkit.common.frames import is_library
from ddpkit.errors import ConfigError
from ddpkit.rank import runtime


class DoubleLaunchError(ConfigError):
    """The script starts its own ranks (mp.spawn) inside a rank that ddpkit run started."""


def patch_spawn(module: ModuleType) -> None:
    original = getattr(module, "start_processes", None)
    if original is None or getattr(original, "_ddpkit_watched", False):
        return

    def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *rest: Any, **kw: Any) -> Any:
        if runtime.current().is_rank() and not _joined():
            raise double_launch(fn, nprocs, _script_frame(sys._getframe(1)))
        return original(fn, args, nprocs, *rest, **kw)

    start_processes._ddpkit_watched = True  # type: ignore[attr-defined]
    start_processes.__wrapped__ = original  # type: ignore[attr-defined]
    start_processes.__doc__ = original.__doc__
    module.start_processes = start_processes  # type: ignore[attr-defined]


def double_launch(fn: Any, nprocs: int, frame: FrameType | None) -> DoubleLaunchError:
    world = os.environ.get("WORLD_SIZE", "?")
    name = getattr(fn, "__name__", "fn")
    site = (
        f" at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        if frame is not None
        else ""
    )
    return DoubleLaunchError(
        f"mp.spawn({name}, nprocs={nprocs}){site} starts ranks of its own, but ddpkit run "
        f"already started {world} rank(s) and this is one of them: each rank would start a "
        f"world of {nprocs} ({int(world) * nprocs if world.isdigit() else 'N'} processes in "
        "all), and the worlds clash on the script's port",
        fix=f"use one launcher, not two: run the script as it is, `python "
        f"{os.path.basename(sys.argv[0]) if sys.argv else 'script.py'} ...` (mp.spawn starts "
        f"the ranks), or keep `ddpkit run -n {nprocs}` and call {name} once in each rank in "
        f"place of mp.spawn: `{name}(int(os.environ['LOCAL_RANK']), "
        "int(os.environ['WORLD_SIZE']), ...)` (ddpkit run replaces the script's MASTER_PORT)",
    )


def _joined() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _script_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
    return frame
