"""What keeping the last completed step costs (issue 38: at most 0.5% of a step), in one job:
blocks of training steps through an `s.loader` with the rescue armed (the objects remembered as
`s.save_state` remembers them: each step's boundary takes its snapshot) alternate with blocks
with it disarmed; each block is timed end to end (synchronised on a GPU) after a warm-up.
Printed: the median step each way, the median paired difference, and the snapshot's own mean
time measured inside the armed blocks, against the step.

    ddpkit run -n 2 benchmarks/rescue_snapshot_cost.py --model digits   # CPU: gloo, 4 ms steps
    ddpkit run -n 2 benchmarks/rescue_snapshot_cost.py --model wide     # CPU: a larger step
    python benchmarks/rescue_snapshot_cost.py --model wide --batch 512  # one GPU
    python benchmarks/rescue_snapshot_cost.py --model gpt --batch 8     # one GPU, a real step
    python benchmarks/rescue_snapshot_cost.py --model resnet --batch 64 # one GPU, 159 buffers

Alone (one rank) the rescue has no peer to serve and stays off; the benchmark arms it as a job
of two would (`--force` is implied for one rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from step_timing_cost import model_and_data  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.train import rescue  # noqa: E402


class Timed:
    """A function of the rescue with the time spent in it added up: before_fetch (every
    fetch's check; at a boundary the snapshot and, when the streams moved since the optimizer
    step, their copy into the rank's file) and _step_ended (the optimizer step's hook: under
    ddpkit run the streams taken and copied into the file)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.count = inner, 0.0, 0

    def __call__(self, *args):
        began = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - began
            self.count += 1


def block(s, model, opt, sched, loader, steps: int) -> float:
    """Seconds per step over `steps` steps of the s.loader (its passes as training has them)."""
    done = 0
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    while done < steps:
        for x, y in loader:
            with torch.autocast("cuda", torch.bfloat16, enabled=s.device.type == "cuda"):
                out = model(x)
            loss = nn.functional.cross_entropy(
                out.reshape(-1, out.shape[-1]).float(), y.reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            done += 1
            if done == steps:
                break
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default="digits", choices=["digits", "wide", "convnet", "gpt", "resnet"]
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    with ddpkit.setup(seed=0) as s:
        if args.model == "wide":  # a larger step: an MLP of 2 x 2048 on 1024 features
            g = torch.Generator().manual_seed(0)
            inputs = torch.randn(4096, 1024, generator=g)
            dataset = torch.utils.data.TensorDataset(
                inputs, torch.randint(0, 10, (4096,), generator=g)
            )
            model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                                  nn.ReLU(), nn.Linear(2048, 10)).to(s.device)  # fmt: skip
        elif args.model == "convnet":  # buffers: 53 BatchNorms (a ResNet-50 has 53, 159 buffers)
            g = torch.Generator().manual_seed(0)
            inputs = torch.randn(1024, 3, 16, 16, generator=g)
            dataset = torch.utils.data.TensorDataset(
                inputs, torch.randint(0, 10, (1024,), generator=g)
            )
            blocks = [nn.Sequential(nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1),
                                    nn.BatchNorm2d(16), nn.ReLU()) for i in range(53)]  # fmt: skip
            model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(16 * 16 * 16, 10)).to(s.device)
        elif args.model in ("gpt", "resnet"):  # GPT-2-small, ResNet-50 (bf16 autocast on a GPU)
            from ddpkit.bench import models

            model, make = getattr(models, args.model)()
            x, y = make(4 * args.batch, torch.device("cpu"))
            dataset = torch.utils.data.TensorDataset(x, y.reshape(len(x), -1).squeeze(1))
            model = model.to(s.device)
        else:  # the demo's: digits, its MLP
            model, data = model_and_data(args.model, args.batch, s.device)
            dataset = data.dataset
        model = s.wrap(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
        loader = s.loader(dataset, batch_size=args.batch, to_device=True)
        counters = {"step": 0, "epoch": 0}
        objects = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader,
                   "counters": counters}  # fmt: skip
        place = s.place if s.world_size > 1 else dataclasses.replace(s.place, world_size=2)
        timed = Timed(rescue.before_fetch)
        rescue.before_fetch = timed
        hooked = Timed(rescue._step_ended)  # registered as the hook at the first remember
        rescue._step_ended = hooked
        block(s, model, opt, sched, loader, args.steps)  # warm-up
        armed, bare = [], []
        for _ in range(args.blocks):
            rescue.remember(Path("unused"), objects, place)
            armed.append(block(s, model, opt, sched, loader, args.steps))
            rescue.forget()
            bare.append(block(s, model, opt, sched, loader, args.steps))
        if s.is_main:
            step, with_ = statistics.median(bare), statistics.median(armed)
            paired = statistics.median(a - b for a, b in zip(armed, bare, strict=True))
            armed_steps = max(hooked.count // 2, 1)  # the hook runs in the disarmed blocks too
            snap = (timed.seconds + hooked.seconds) / armed_steps
            params = sum(p.numel() for p in model.parameters())
            print(f"model {args.model} ({params / 1e6:.2f} M parameters), batch {args.batch}, "
                  f"{s.world_size} rank(s), {s.device.type}")  # fmt: skip
            print(f"{'step, rescue off':<28}{step * 1e3:10.3f} ms")
            print(f"{'step, rescue armed':<28}{with_ * 1e3:10.3f} ms")
            print(f"{'median paired difference':<28}{paired * 1e6:10.1f} us "
                  f"({100 * paired / step:+.2f}% of a step)")  # fmt: skip
            print(f"{'rescue, per step':<28}{snap * 1e6:10.1f} us ({100 * snap / step:.2f}% of a "
                  f"step; {armed_steps} steps armed)")  # fmt: skip


if __name__ == "__main__":
    main()
