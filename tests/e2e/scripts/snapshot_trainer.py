"""A trainer in the shape of pytorch/examples' distributed/ddp-tutorial-series
multigpu_torchrun.py (a Trainer class, `_run_epoch`, `_save_snapshot` every `save_every` epochs,
`_load_snapshot` at start, `total_epochs save_every --batch_size`), with ddpkit's setup, loader
and state in place of the tutorial's. It saves when asked to stop, so a job stopped on N ranks
can go on with M; `--save_steps N` saves every N steps too; `--fail_rank R --fail_step S`:
rank R fails at step S of the first attempt; comma lists (`--fail_rank 1,0 --fail_step 3,5
--fail_how raise,kill`) fail once in each attempt in turn, the lists' last entries standing for
the rest (`--fail_how`: raise an exception, SIGKILL itself,
segfault, exit with code 3, or allocate host memory until the kernel's OOM killer ends it, run
inside a memory cgroup with a limit;
`--fail_where before|after`: before its forward, or after its optimizer step; `--stamps`: the
wall time of the failure and of each step, for benchmarks/restart_cost.py;
`--kill_after SECONDS`: SIGKILL that long after training began, wherever it is; `-j N`: N
DataLoader workers, which inherit the rank's connections to its peers). `--augment`
draws from every random stream each step, as augmentation does (Python's random flips, numpy's
noise, torch's dropout; a BatchNorm's running statistics move with each forward). Every rank
prints the sample ids of each batch it trains on: `rank R attempt A epoch E step S samples
3,17,...` (A: the launcher's restart count) and rank 0 each step's global loss.

    ddpkit run -n 4 snapshot_trainer.py 2 1 --batch_size 3 --snapshot_path STATE [--sleep S]
"""

import argparse
import ctypes
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

import ddpkit


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.size = size
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index][0], self.data[index][1], index


class Trainer:
    def __init__(self, s, model, train_data, optimizer, save_every, snapshot_path, sleep, steps,
                 fail=([-1], [], ["raise"], "before", 0.0), augment=False,
                 stamps=False):  # fmt: skip
        self.s = s
        self.augment = augment
        self.stamps = stamps
        self.model = s.wrap(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.sleep = sleep
        self.save_steps = steps
        self.fail_ranks, self.fail_steps, self.fail_hows, self.fail_where, kill_after = fail
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if kill_after and self.attempt == 0 and s.rank == self.fail_ranks[0]:  # a random moment
            threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        self.meta = {"epochs_run": 0, "step": 0}
        self.to_save = {"model": self.model, "optimizer": optimizer, "loader": train_data}
        self.to_save["meta"] = self.meta
        if s.load_state(snapshot_path, **self.to_save):
            epoch, step = self.meta["epochs_run"], self.meta["step"]
            s.print(f"Resuming training from snapshot at Epoch {epoch} step {step}", flush=True)

    def _fail(self, where):
        if self.attempt >= len(self.fail_steps) or where != self.fail_where:
            return
        step = self.fail_steps[self.attempt]
        rank = self.fail_ranks[min(self.attempt, len(self.fail_ranks) - 1)]
        how = self.fail_hows[min(self.attempt, len(self.fail_hows) - 1)]
        if self.s.rank != rank or self.meta["step"] + 1 != step:
            return
        if self.stamps:
            print(f"stamp failed {time.time()!r}", flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)
        elif how == "exit":
            sys.exit(3)
        elif how == "oom":
            held = []
            while True:
                held.append(torch.ones(64 * 2**20 // 4))  # 64 MiB, touched
        raise RuntimeError(f"boom at step {step}")

    def _run_batch(self, source, targets):
        self._fail("before")
        if self.augment:
            if random.random() < 0.5:
                source = source.flip(1)
            source = source + torch.from_numpy(np.random.normal(0, 0.01, source.shape)).float()
        source, targets = source.to(self.s.device), targets.to(self.s.device)
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self._fail("after")
        count = torch.tensor(float(len(source)), device=self.s.device)
        total = torch.stack([loss.detach() * len(source), count])
        dist.all_reduce(total)
        self.meta["step"] += 1
        self.s.print(f"step {self.meta['step']} loss {(total[0] / total[1]).item()!r}", flush=True)
        if self.stamps and self.s.is_main:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            print(f"stamp attempt {attempt} step {self.meta['step']} {time.time()!r}", flush=True)

    def _run_epoch(self, epoch):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        for source, targets, index in self.train_data:
            self._run_batch(source, targets)
            print(f"rank {self.s.rank} attempt {attempt} epoch {epoch} step {self.meta['step']} "
                  f"samples {','.join(map(str, index.tolist()))}", flush=True)  # fmt: skip
            if self.save_steps and self.meta["step"] % self.save_steps == 0:
                self.s.save_state(self.snapshot_path, **self.to_save)
            if self.s.stop_requested:
                self.s.save_state(self.snapshot_path, **self.to_save)
                self.s.print(f"stopped at step {self.meta['step']}, snapshot saved", flush=True)
                sys.exit(0)
            time.sleep(self.sleep)

    def train(self, max_epochs):
        for epoch in range(self.meta["epochs_run"], max_epochs):
            self.meta["epochs_run"] = epoch
            self._run_epoch(epoch)
            self.meta["epochs_run"] = epoch + 1
            if epoch % self.save_every == 0:
                self.s.save_state(self.snapshot_path, **self.to_save)


def main(save_every, total_epochs, batch_size, snapshot_path, sleep, save_steps, fail, augment,
         stamps, workers):  # fmt: skip
    with ddpkit.setup(seed=0) as s:
        torch.manual_seed(0)
        dataset = MyTrainDataset(240)
        model = torch.nn.Linear(20, 1)
        if augment:
            model = torch.nn.Sequential(torch.nn.BatchNorm1d(20), torch.nn.Dropout(0.2), model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        train_data = s.loader(dataset, batch_size=batch_size, num_workers=workers)
        trainer = Trainer(
            s,
            model,
            train_data,
            optimizer,
            save_every,
            snapshot_path,
            sleep,
            save_steps,
            fail,
            augment,
            stamps,
        )
        trainer.train(total_epochs)
        s.print("finished", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument(
        "--batch_size", default=32, type=int, help="Input batch size on each device"
    )
    parser.add_argument("--snapshot_path", default="snapshot", type=str)
    parser.add_argument("--sleep", default=0.0, type=float, help="seconds per step")
    parser.add_argument("--save_steps", default=0, type=int, help="also save every N steps")
    parser.add_argument("--fail_rank", default="-1", help="this rank raises ... (or R,R,...)")
    parser.add_argument("--fail_step", default="", help="... at this step, once (or S,S,...)")
    parser.add_argument("--fail_how", default="raise", help="raise|kill|segfault|exit|oom (,...)")
    parser.add_argument("--fail_where", default="before", choices=["before", "after"])
    parser.add_argument("--kill_after", default=0.0, type=float, help="seconds, on --fail_rank")
    parser.add_argument("--augment", action="store_true", help="random flips, noise, dropout")
    parser.add_argument("--stamps", action="store_true", help="wall times: failure, each step")
    parser.add_argument("-j", "--workers", default=0, type=int, help="data loading workers")
    args = parser.parse_args()
    hows = args.fail_how.split(",")
    if not set(hows) <= {"raise", "kill", "segfault", "exit", "oom"}:
        parser.error(f"--fail_how: {args.fail_how}")
    ranks = [int(r) for r in args.fail_rank.split(",")]
    steps = [int(n) for n in args.fail_step.split(",") if n]
    fail = (ranks, steps, hows, args.fail_where, args.kill_after)
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.sleep,
         args.save_steps, fail, args.augment, args.stamps, args.workers)  # fmt: skip
