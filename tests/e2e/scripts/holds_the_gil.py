"""After init, rank 1 blocks in a C call that holds the GIL (as a buggy extension can): no CPU
used, no Python thread of it runs, so it answers a stack request (faulthandler is C) but not
a flight-recorder request. The other ranks wait for it in all_reduce."""

import ctypes
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print("ready", flush=True)
if int(os.environ["RANK"]) == 1:
    read_fd, _ = os.pipe()
    ctypes.PyDLL(None).read(read_fd, ctypes.create_string_buffer(1), 1)  # never returns
dist.all_reduce(torch.ones(1))
