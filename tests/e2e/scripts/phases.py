"""Stops in the phase named by argv[1]: before-init, in-init (rank 1 never arrives), training,
collective (rank 1 never joins the all_reduce). Prints 'ready' when there."""

import os
import sys
import time

import torch
import torch.distributed as dist

phase, rank = sys.argv[1], int(os.environ["RANK"])
if phase == "before-init":
    print("ready", flush=True)
    time.sleep(600)
if phase == "in-init" and rank == 1:
    time.sleep(600)
if phase == "in-init":
    print("ready", flush=True)
dist.init_process_group("gloo")
if phase == "training":
    print("ready", flush=True)
    while True:
        sum(i * i for i in range(10000))
if phase == "collective":
    print("ready", flush=True)
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
