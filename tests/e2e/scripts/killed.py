"""Rank 1 dies of SIGKILL after init (as the OOM killer would do)."""

import os
import signal
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
