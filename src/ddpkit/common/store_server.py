"""A TCPStore server on a listening socket that is already open: the launcher binds the job's
port (so no other process can take it between choosing and using it) and hands the socket to
whoever serves the store: the launcher itself (several nodes, `--no-python`), or rank 0 of a
one-node job, which then needs no torch in the launcher (a third of a 2-rank job's CPU).

The server is multi-tenant: torch's own `init_process_group` (env://) on rank 0, and
`ddpkit.setup()`, find it by its port and use it instead of binding another. Nothing here
imports torch until a server is made.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when a server is made
    from torch._C._distributed_c10d import TCPStore


def serve_fd(fd: int, addr: str, port: int, timeout: float, multi_tenant: bool = False) -> TCPStore:
    """A TCPStore server on the listening socket `fd` (left open: the caller closes it)."""
    import torch.distributed as dist

    # libuv's server takes a listening fd from torch 2.8 on (pytorch#150215); before, it logs
    # an error first, so older torch goes straight to the legacy server. Each try gets a copy
    # of the fd: a server that fails may have closed the one it was given.
    for use_libuv in (True, False) if _torch_at_least(2, 8) else (False,):
        attempt = os.dup(fd)
        try:
            return dist.TCPStore(  # type: ignore[attr-defined]
                addr,
                port,
                None,
                True,
                timedelta(seconds=timeout),
                wait_for_workers=False,
                multi_tenant=multi_tenant,
                master_listen_fd=attempt,
                use_libuv=use_libuv,
            )
        except (RuntimeError, ValueError, TypeError, OSError):
            # not closed here: the failed server may have closed it, and its number may be
            # another file's by now (one descriptor left open, once, at worst)
            continue
    from ddpkit.errors import LaunchError

    raise LaunchError(
        f"could not start the job's store on {addr}:{port}",
        fix="pass --master-port with a free port",
    )


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    try:
        have = tuple(int(p) for p in torch.__version__.split(".")[:2])
    except ValueError:
        return True
    return have >= (major, minor)
