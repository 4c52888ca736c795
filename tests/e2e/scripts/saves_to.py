"""Every rank saves a checkpoint of argv[2] MiB to argv[1] with s.save, then says so."""

import sys

import torch

import ddpkit

with ddpkit.setup() as s:
    state = {"w": torch.zeros(int(sys.argv[2]) * 2**18)}  # float32: 4 bytes each
    s.save(state, sys.argv[1])
    print("saved", flush=True)
