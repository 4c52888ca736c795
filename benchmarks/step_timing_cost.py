"""What timing every step costs (issue 22: at most 0.5% of a step), measured in one run: blocks
of training steps with ddpkit's step timing installed (ddpkit.rank.steps: the optimizer hook,
the timed backward and DataLoader, the last gradient's hook, CUDA events) alternate with blocks
without it; each block is timed end to end (synchronised on a GPU), after a warm-up; the table
gives the median step of each and their ratio.

    python benchmarks/step_timing_cost.py --device cuda --model gpt --batch 8   # 1 H200, bf16
    python benchmarks/step_timing_cost.py --device cpu --model digits           # the CPU demo's

One process, world size 1: what is measured is the rank's own cost, which does not depend on
how many ranks there are (each rank times only itself).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def model_and_data(name: str, batch: int, device: torch.device):
    if name == "gpt":
        from ddpkit.bench.models import gpt

        model, make = gpt()
        x, y = make(batch, device)
        data = [(x, y)] * 64
    else:  # the demo's: digits, its MLP, its batch size
        from ddpkit.examples.digits import build_model, load_digits

        images, labels = load_digits()
        data_set = torch.utils.data.TensorDataset(images, labels)
        loader = torch.utils.data.DataLoader(data_set, batch_size=batch, shuffle=True)
        data = loader
        model = build_model()
    return model.to(device), data


def endless(data):
    """The DataLoader's batches again and again, each pass a fresh iter() (so a timed loader is
    timed on every batch, as in training; itertools.cycle would replay stored batches)."""
    while True:
        yield from data


def run_block(model, opt, data, steps: int, device: torch.device, bf16: bool) -> float:
    """Seconds per step over `steps` steps (the DataLoader's batches reused in a cycle)."""
    batches = endless(data)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        ctx = torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps


def host_cost_us(device: torch.device, steps: int = 5000, repeats: int = 7) -> float:
    """Microseconds per step the timing adds on the host: steps of a one-parameter model (so
    the step itself is tiny and steady), with and without the hooks, the best of `repeats`."""
    from ddpkit.rank.steps import timed_here

    w = nn.Parameter(torch.ones(8, device=device))
    opt = torch.optim.SGD([w], lr=1e-3)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(64, 8)))

    def loop() -> float:
        batches = endless(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            (x,) = next(batches)
            (w * x.to(device)).sum().backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - began) / steps * 1e6

    record = Path(tempfile.mkdtemp()) / "rank0.steps"
    off, on = [], []
    for _ in range(repeats):
        off.append(loop())
        remove = timed_here(record)
        loop()  # learning the last gradient, GPU events warm
        on.append(loop())
        remove()
    return min(on) - min(off)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["gpt", "digits"], default="gpt")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--rounds", type=int, default=8, help="blocks of each kind")
    args = p.parse_args()
    from ddpkit.rank.steps import timed_here

    device = torch.device(args.device)
    model, data = model_and_data(args.model, args.batch, device)
    bf16 = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    run_block(model, opt, data, args.steps, device, bf16)  # warm-up
    record = Path(tempfile.mkdtemp()) / "rank0.steps"
    off, on = [], []
    for i in range(args.rounds):  # alternate which goes first, so drift hits both alike
        for timed_now in (False, True) if i % 2 == 0 else (True, False):
            remove = timed_here(record) if timed_now else None
            run_block(model, opt, data, 2, device, bf16)  # untimed: learning the last gradient
            took = run_block(model, opt, data, args.steps, device, bf16)
            (on if timed_now else off).append(took)
            if remove is not None:
                remove()
    from ddpkit.common import protocol

    timed = protocol.read_steps(record.parent, 0)
    t_off, t_on = statistics.median(off), statistics.median(on)
    paired = statistics.median(b - a for a, b in zip(off, on, strict=True)) / t_off
    print(f"# step timing cost: {args.model} batch {args.batch} on {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"{args.rounds} blocks of {args.steps} steps each way, medians")  # fmt: skip
    print(f"{'without':>10} {'with':>10} {'cost':>8} {'paired':>8}  steps recorded")
    print(
        f"{t_off * 1e3:>8.2f}ms {t_on * 1e3:>8.2f}ms {(t_on - t_off) / t_off:>+8.2%} "
        f"{paired:>+8.2%}  {timed.count if timed else 0}"
    )
    spread = (statistics.quantiles(off, n=4)[2] - statistics.quantiles(off, n=4)[0]) / t_off
    print(f"# noise: the IQR of the blocks without timing is {spread:.2%} of a step")
    cost = host_cost_us(device)
    print(
        f"# host cost of the timing, measured on a one-parameter step: {cost:.1f} us per step "
        f"= {cost / (t_off * 1e6):.3%} of this step"
    )
    if timed and timed.steps:
        last = timed.steps[-1]
        print(
            f"# last timed step: total {last.total * 1e3:.2f} ms = data {last.data * 1e3:.2f} "
            f"+ compute {last.compute * 1e3:.2f} + comm {last.comm * 1e3:.2f} + host "
            f"{last.host * 1e3:.2f}"
        )


if __name__ == "__main__":
    main()
