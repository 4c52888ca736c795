"""Rank argv[1] allocates host memory until the kernel's OOM killer ends it (run inside a
memory cgroup with a limit, as a pod or a SLURM job is); the others wait in all_reduce."""

import os
import sys
import time

import torch
import torch.distributed as dist

eater = int(sys.argv[1])
dist.init_process_group("gloo")
print("ready", flush=True)
if int(os.environ["RANK"]) == eater:
    held = []
    while True:
        held.append(torch.ones(64 * 2**20 // 4))  # 64 MiB, touched
        time.sleep(0.02)
dist.all_reduce(torch.ones(1))
