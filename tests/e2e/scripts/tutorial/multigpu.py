"""A trainer in the shape of PyTorch's DDP tutorial series (multigpu.py): `ddp_setup` sets its own
MASTER_ADDR/MASTER_PORT and joins with the rank and world size mp.spawn gives it; the main
block starts the ranks with `mp.spawn(main, args=(world_size, ...), nprocs=world_size)`. On
CPUs here: gloo, and the world size from the command line (the tutorial counts GPUs).

    python multigpu.py TOTAL_EPOCHS SAVE_EVERY [--batch_size 32] [--world_size 2]
"""

import os

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every):
        self.gpu_id = gpu_id
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.model = DDP(model)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            F.mse_loss(self.model(source), targets).backward()
            self.optimizer.step()
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Steps: {len(self.train_data)}", flush=True)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                torch.save(self.model.module.state_dict(), "checkpoint.pt")
                print(f"Epoch {epoch} | Training checkpoint saved at checkpoint.pt", flush=True)


def main(rank, world_size, save_every, total_epochs, batch_size):
    ddp_setup(rank, world_size)
    dataset = TensorDataset(torch.randn(256, 20), torch.randn(256, 1))
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))
    Trainer(model, train_data, optimizer, rank, save_every).train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--world_size", default=2, type=int)
    args = parser.parse_args()
    world_size = args.world_size
    mp.spawn(
        main,
        args=(world_size, args.save_every, args.total_epochs, args.batch_size),
        nprocs=world_size,
    )
