"""A script that starts its ranks with ddpkit.spawn, as one written for mp.spawn does:
`main(rank, world_size, mode)` joins with the rank it is given and trains a few steps.

    python train.py MODE [WORLD_SIZE]

MODE: ok | raises (rank 1 raises at step 3) | hangs (rank 1 sleeps before a collective) |
forever (every rank trains until stopped) | caught (the caller catches the failure and says
what it carries) | flaky (rank 1 raises at step 3 of the first attempt only; the caller asks
for a restart) | setup (`ddpkit.setup()` inside main, as in a script)."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit


class Settings:  # an object of the script's own class, pickled to every rank
    def __init__(self, steps):
        self.steps = steps


def with_setup(rank, settings):
    with ddpkit.setup(seed=0) as s:
        model = s.wrap(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(settings.steps):
            loss = F.mse_loss(model(torch.randn(16, 8)), torch.zeros(16, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank}: setup gave rank {s.rank} of {s.world_size}", flush=True)


def main(rank, world_size, mode, settings):
    if mode == "setup":
        with_setup(rank, settings)
        return
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while mode == "forever" or step < settings.steps:
        loss = F.mse_loss(model(torch.randn(16, 8)), torch.zeros(16, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        failing = mode in ("raises", "caught") or (mode == "flaky" and first_attempt)
        if step == 3 and rank == 1 and failing:
            raise ValueError("a bad batch at step 3")
        if step == 3 and rank == 1 and mode == "hangs":
            time.sleep(600)
        if step == 1:
            print(f"rank {rank} of {world_size} stepped, argv {sys.argv[1:]}", flush=True)
        if mode == "forever":
            time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode = sys.argv[1]
    world_size = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    options = {"hangs": {"hang_timeout": 3, "grace": 2}, "flaky": {"max_restarts": 1}}.get(mode, {})
    print(f"caller pid {os.getpid()}", flush=True)
    if mode == "caught":
        try:
            ddpkit.spawn(main, args=(world_size, mode, Settings(6)), nprocs=world_size)
        except ddpkit.JobFailedError as failed:
            print(
                f"caught: exit code {failed.exit_code}; root cause: {failed.root_cause}; "
                f"fix: {failed.fix}; run dir {failed.run_dir}",
                flush=True,
            )
        sys.exit(0)
    ddpkit.spawn(main, args=(world_size, mode, Settings(6)), nprocs=world_size, **options)
    print("the caller goes on after the job", flush=True)
