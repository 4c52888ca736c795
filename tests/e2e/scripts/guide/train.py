"""The classic guide's script, as its reader writes it: RANK from the environment, the GPU by
`rank % num_gpus`, nccl, DDP with device_ids=[rank], `model.module` to save; started with
`python -m torch.distributed.launch --nproc_per_node=3 --master_port=1010 train.py`."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    rank = int(os.environ["RANK"])
    num_gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % num_gpus)
    dist.init_process_group(backend="nccl")
    device = "cuda"

    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp_model = DDP(model, device_ids=[rank])
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    for step in range(20):
        inputs = torch.randn(16, 10).to(device)
        labels = torch.randn(16, 1).to(device)
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(inputs), labels)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    if rank == 0:
        torch.save(ddp_model.module.state_dict(), "model.pt")
        print("saved model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
