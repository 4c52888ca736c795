"""`s.stop_requested`: stopping on a signal at a step boundary, on every rank at the same step.

Reading it once says that the script stops on its own: from then on SIGTERM, SIGINT and
SIGUSR1 (from `ddpkit run`, which forwards them, from srun, or from a scheduler's pre-emption)
only set a flag, so the loop can save its state and leave. Every read agrees across ranks (a
one-element all-reduce of the flags, max), so all ranks see True at the same step and none is
left waiting in a collective. A script that never reads it keeps Python's own behaviour.

The rank also tells the launcher (a state file, `ddpkit.protocol.GRACEFUL`) so that, after
forwarding a stop signal, it gives the ranks longer than --grace to save before it kills.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ddpkit import protocol

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopFlag:
    def __init__(self) -> None:
        self.local = False
        self.signal: int | None = None
        self.installed = False

    def install(self) -> None:
        """Catch the stop signals (main thread only, as Python requires)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        self.installed = True
        state_dir = os.environ.get(protocol.STATE_DIR)
        if state_dir:
            try:
                rank = os.environ.get("RANK", "0")
                protocol.state_path(state_dir, rank, protocol.GRACEFUL).touch()
            except OSError:
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.local = True
        self.signal = signum

    def agreed(self, world_size: int, device: Any) -> bool:
        """True on every rank once any rank got a stop signal."""
        self.install()
        if world_size == 1:
            return self.local
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.local = bool(flag.item())
        return self.local
