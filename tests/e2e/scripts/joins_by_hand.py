"""A script started the way the classic guide starts each rank by hand (`RANK=1 WORLD_SIZE=2
python train.py`), with ddpkit.setup() where the guide calls init_process_group."""

import time

import torch

import ddpkit

print(f"calling setup at {time.time():.3f}", flush=True)
s = ddpkit.setup()
print(f"rank {s.rank} of {s.world_size} joined", flush=True)
print(torch.ones(1))
