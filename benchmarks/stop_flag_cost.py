"""What reading `s.stop_requested` every step costs (issue 27: at most 0.5% of a step), in one
job: blocks of training steps that read it after every optimizer step alternate with blocks
that do not; each block is timed end to end (synchronised on a GPU) after a warm-up. Printed:
the median step each way, the median paired difference, and the host's cost of one read
in the training steps themselves (the mean over every read, comparisons and their waits
included), against the step; and a tight loop's figure (one-parameter steps).

    ddpkit run -n 2 benchmarks/stop_flag_cost.py --device cpu --model digits   # CPU, gloo
    ddpkit run -n 4 benchmarks/stop_flag_cost.py --device cpu --model digits
    python benchmarks/stop_flag_cost.py --device cuda --model gpt --batch 8 --force   # 1 H200

--force makes a job of one rank compare flags as a job of many does (a gloo group of that one
rank, the asynchronous compare and its wait): alone, a read returns at once.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from step_timing_cost import endless, model_and_data  # noqa: E402

import ddpkit  # noqa: E402


class TimedRead:
    """The read, with the time spent in it added up (host time, as the step sees it)."""

    def __init__(self, read) -> None:
        self.read, self.seconds, self.count = read, 0.0, 0

    def __call__(self) -> bool:
        began = time.perf_counter()
        try:
            return self.read()
        finally:
            self.seconds += time.perf_counter() - began
            self.count += 1


def run_block(s, model, opt, data, steps, device, bf16, read) -> float:
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
        if read() is True:
            raise SystemExit("a stop was asked for during the benchmark")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps


def read_cost_us(read, reads: int = 4000, repeats: int = 7) -> float:
    """Microseconds one read adds to a one-parameter step, the best of `repeats` loops."""
    w = nn.Parameter(torch.ones(8))
    opt = torch.optim.SGD([w], lr=1e-3)

    def loop(with_read: bool) -> float:
        began = time.perf_counter()
        for _ in range(reads):
            w.grad = torch.ones(8)
            opt.step()
            if with_read:
                read()
        return (time.perf_counter() - began) / reads * 1e6

    return min(loop(True) for _ in range(repeats)) - min(loop(False) for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["gpt", "digits"], default="gpt")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--rounds", type=int, default=10, help="blocks of each kind")
    p.add_argument("--force", action="store_true", help="compare flags even alone")
    args = p.parse_args()
    device = torch.device(args.device)
    with ddpkit.setup(seed=0) as s:
        if args.force:
            world = max(2, s.world_size)  # the many-rank path on this job's ranks

            def read() -> bool:
                return s._stop.agreed(world)
        else:

            def read() -> bool:
                return s.stop_requested

        model, data = model_and_data(args.model, args.batch, s.device if device.type else device)
        model = s.wrap(model)
        bf16 = device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        read()  # the first read compares at once, and starts the watch
        timed = TimedRead(read)
        run_block(s, model, opt, data, args.steps, device, bf16, timed)  # warm-up
        timed.seconds, timed.count = 0.0, 0
        off, on = [], []
        for i in range(args.rounds):  # alternate which goes first, so drift hits both alike
            for reading in (False, True) if i % 2 == 0 else (True, False):
                took = run_block(
                    s, model, opt, data, args.steps, device, bf16, timed if reading else bool
                )
                (on if reading else off).append(took)
        in_reads = timed.seconds / timed.count  # every read, comparisons and their waits too
        per_read = read_cost_us(read)
        t_off, t_on = statistics.median(off), statistics.median(on)
        paired = statistics.median(b - a for a, b in zip(off, on, strict=True)) / t_off
        # how much blocks of the same kind differ: the noise a blocks' difference must clear
        noise = statistics.median(abs(a - b) for a, b in zip(off, off[1:], strict=False)) / t_off
        if s.is_main:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
            forced = ", forced compare" if args.force else ""
            print(
                f"# s.stop_requested every step: {args.model} batch {args.batch} on {name}, "
                f"world size {s.world_size}{forced}, {args.rounds} blocks of {args.steps} "
                "steps each way, medians"
            )
            print(
                "in reads: the mean time a step spent reading it (comparisons, their waits),"
                " against the median step without reads; blocks: the median block with reads"
                " against without; noise: how much two blocks of the same kind differ"
            )
            print(f"{'without':>10} {'with':>10} {'blocks':>8} {'paired':>8} {'noise':>7} "
                  f"{'in reads':>10} {'share':>8} {'tight loop':>11}")  # fmt: skip
            print(
                f"{t_off * 1e3:>8.2f}ms {t_on * 1e3:>8.2f}ms {(t_on - t_off) / t_off:>+8.2%} "
                f"{paired:>+8.2%} {noise:>7.2%} {in_reads * 1e6:>8.1f}us "
                f"{in_reads / t_off:>8.3%} {per_read:>9.1f}us"
            )


if __name__ == "__main__":
    main()
