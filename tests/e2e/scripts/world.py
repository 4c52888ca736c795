"""all_reduce of ones: prints 'rank R of W sum S', then sleeps argv[1] seconds."""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {int(t.item())}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
dist.barrier()
dist.destroy_process_group()
