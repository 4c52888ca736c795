"""The set-up of PyTorch's DDP tutorial (pytorch/examples, distributed/ddp-tutorial-series,
multigpu.py), moved from mp.spawn to a launcher the way users move it: `ddp_setup` still sets
its own MASTER_ADDR/MASTER_PORT and passes rank and world_size. argv[1] chooses the mistake:

world N     world_size=N passed (the tutorial's torch.cuda.device_count(), here a number)
rank0       rank=0 passed on every rank (a copied `main(0, world_size)`)
port        the launcher's world size and rank, the tutorial's own port: trains 20 steps
file        init_method='file://...' with a file of each rank's own: the ranks never meet
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    if sys.argv[1] == "file":
        where = f"file://{os.path.abspath(f'rendezvous_{os.getpid()}')}"
        init_process_group(backend="gloo", init_method=where, rank=rank, world_size=world_size)
    else:
        init_process_group(backend="gloo", rank=rank, world_size=world_size)


def main(rank, world_size):
    ddp_setup(rank, world_size)
    model = DDP(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _step in range(20):
        source, targets = torch.randn(32, 20), torch.randn(32, 1)
        optimizer.zero_grad()
        F.mse_loss(model(source), targets).backward()
        optimizer.step()
        time.sleep(0.1)
    print(f"[GPU{rank}] trained 20 steps", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if mode == "world":
        world_size = int(sys.argv[2])
    if mode == "rank0":
        rank = 0
    main(rank, world_size)
