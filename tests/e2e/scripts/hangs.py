"""A hang chosen by argv[1]; prints 'stall' just before it (line numbers are asserted)."""

import os
import sys
import time

import torch
import torch.distributed as dist

case = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()


def stuck_here():
    time.sleep(600)  # @stuck-here


class StuckOnRank1(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 2 and os.environ["RANK"] == "1":
            time.sleep(600)  # a DataLoader worker that never returns
        return torch.ones(2)


print("stall", flush=True)
if case == "sleep":
    if rank == 1:
        stuck_here()  # @rank-1-sleeps
    dist.all_reduce(torch.ones(1))  # @sleep-collective
elif case == "only-rank-0":
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # @rank-0-only
    dist.barrier()  # @others-barrier
elif case == "skipped-barrier":
    if rank != 1:
        dist.barrier()  # @skipped-barrier
    stuck_here()
elif case == "loader":
    loader = torch.utils.data.DataLoader(StuckOnRank1(), batch_size=1, num_workers=1)
    for batch in loader:  # @loader-loop
        dist.all_reduce(batch)  # @loader-collective
elif case in ("compute", "warm-up"):
    # compute: rank 1 computes while the others wait; warm-up: every rank is busy before its
    # first step (torch.compile, a cache warming)
    if rank == 1 or case == "warm-up":
        end = time.time() + float(sys.argv[2])
        x = torch.randn(128, 128)
        while time.time() < end:
            x = (x @ x).tanh()
    dist.all_reduce(torch.ones(1))
    print("finished", flush=True)
elif case == "slow-save":  # rank 0 writes a checkpoint to a slow disk; the others wait
    if rank == 0:
        end = time.time() + float(sys.argv[2])
        with open(os.path.join(sys.argv[3], "checkpoint.pt"), "wb") as f:
            while time.time() < end:  # 1 MB/s, flushed to the disk as it goes
                f.write(b"x" * 100_000)
                f.flush()
                os.fsync(f.fileno())
                time.sleep(0.1)
    dist.barrier()
    print("finished", flush=True)
elif case == "idle":
    time.sleep(float(sys.argv[2]))
    dist.all_reduce(torch.ones(1))
    print("finished", flush=True)
elif case == "shapes":
    dist.all_reduce(torch.ones(4 + rank))  # @shapes-collective
