"""ddpkit: NCCL multi-GPU training with PyTorch that works the first time.

    import ddpkit
    s = ddpkit.setup()
    model = s.wrap(model)

    ddpkit.spawn(main, args=(...), nprocs=4)   # mp.spawn's call, ddpkit run underneath

This module only re-exports. Names are resolved lazily so that `ddpkit --help` and the launcher
start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit._version import __version__
from ddpkit.errors import DdpkitError

if TYPE_CHECKING:
    from ddpkit.env import DistEnv, read_env  # noqa: F401
    from ddpkit.spawning import JobFailedError, spawn  # noqa: F401
    from ddpkit.train.seeding import seed_everything  # noqa: F401
    from ddpkit.train.session import Session, Step, setup  # noqa: F401
    from ddpkit.train.wrapping import unwrap  # noqa: F401

_LAZY = {
    "setup": "ddpkit.train.session",
    "unwrap": "ddpkit.train.wrapping",
    "Session": "ddpkit.train.session",
    "Step": "ddpkit.train.session",
    "DistEnv": "ddpkit.env",
    "read_env": "ddpkit.env",
    "seed_everything": "ddpkit.train.seeding",
    "spawn": "ddpkit.spawning",
    "JobFailedError": "ddpkit.spawning",
}

__all__ = ["DdpkitError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
