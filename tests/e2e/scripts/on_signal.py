"""Handles the signal named in argv[2] itself (as SLURM pre-emption scripts handle SIGUSR1):
writes a file and exits 0. argv[3] == "hang": the ranks then wait in a collective forever."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out, name = Path(sys.argv[1]), sys.argv[2]
rank = os.environ["RANK"]


def handler(signum, frame):
    (out / f"{name}-{rank}").write_text("1")
    sys.exit(0)


signal.signal(getattr(signal, name), handler)
dist.init_process_group("gloo")
print("ready", flush=True)
if len(sys.argv) > 3 and sys.argv[3] == "hang" and rank == "1":
    time.sleep(600)
dist.all_reduce(torch.ones(1))
time.sleep(600)
