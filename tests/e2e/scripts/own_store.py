"""A script that makes its own store on a fixed port (argv[1]), as some older examples do;
the port is already taken on this machine."""

import os
import sys
from datetime import timedelta

import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), world, rank == 0, timedelta(seconds=20))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
