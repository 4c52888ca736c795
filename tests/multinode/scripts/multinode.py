"""Multi-node DDP training in the style of the PyTorch DDP tutorial series (multinode.py):
the launcher sets the environment, the script reads RANK/LOCAL_RANK and calls
init_process_group itself. CPU and gloo, so it runs on machines without GPUs.

    ddpkit run --nnodes 2 -n 2 --rdzv node0:29400 multinode.py 3 1
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch, args):
        b_sz = len(next(iter(self.train_data))[0])
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source, targets)
        print(
            f"[{socket.gethostname()} rank {self.global_rank}] Epoch {epoch} | Batchsize: "
            f"{b_sz} | Steps: {len(self.train_data)} | loss {loss:.4f}",
            flush=True,
        )
        first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        if args.fail_rank == self.global_rank and (first or args.fail_always):
            sys.exit(args.fail_code)
        if args.compute_rank in (self.global_rank, -2) and epoch == 0:
            end = time.time() + args.compute_seconds  # a long step: busy, not hung
            x = torch.randn(128, 128)
            while time.time() < end:
                x = (x @ x).tanh()
        if args.stall_rank == self.global_rank and epoch == args.stall_epoch:
            print("stall", flush=True)
            time.sleep(600)  # never reaches the next epoch's all-reduce

    def train(self, max_epochs, args):
        while int(os.environ["WORLD_SIZE"]) < args.wait_for_world:  # elastic: more to come
            time.sleep(0.2)
        for epoch in range(max_epochs):
            self._run_epoch(epoch, args)
            if args.sleep:
                time.sleep(args.sleep)


def main(args):
    ddp_setup()
    print(
        f"[{socket.gethostname()} rank {os.environ['RANK']}] MASTER_ADDR="
        f"{os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']} "
        f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
        f"world={os.environ['WORLD_SIZE']}",
        flush=True,
    )
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    trainer = Trainer(model, loader, optimizer)
    trainer.train(args.total_epochs, args)
    destroy_process_group()
    print(f"[{socket.gethostname()} rank {os.environ['RANK']}] done", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, nargs="?", default=1, help="How often to save")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size")
    parser.add_argument("--sleep", default=0.0, type=float, help="seconds between epochs")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-code", type=int, default=3)
    parser.add_argument("--fail-always", action="store_true", help="after restarts too")
    parser.add_argument("--compute-rank", type=int, default=-1, help="-2: every rank")
    parser.add_argument("--compute-seconds", type=float, default=0.0)
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-epoch", type=int, default=0)
    parser.add_argument("--wait-for-world", type=int, default=0, help="idle until this many")
    main(parser.parse_args())
