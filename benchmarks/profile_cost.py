"""What `ddpkit profile` costs (issue 39): nothing armed, and while it records, in one run.

Nothing armed, the rank's step hook (ddpkit.rank.steps) reads one module attribute a step
(`profiling.plan is not None`): its time, measured with timeit, against the step. While
recording, blocks of steps with torch's profiler on (armed by a plan, as a rank is) alternate
with blocks without, both under the step timing as under `ddpkit run`; each block is timed end
to end after a warm-up (synchronised on a GPU); the table gives the median step of each, their
ratio, and what writing the trace took at the end of each recording.

    python benchmarks/profile_cost.py --device cpu --model digits
    python benchmarks/profile_cost.py --device cuda --model gpt --batch 8   # 1 H200, bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import timeit
from pathlib import Path

import torch
from step_timing_cost import model_and_data, run_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["gpt", "digits"], default="digits")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="steps per block (and recorded)")
    p.add_argument("--rounds", type=int, default=6, help="blocks of each kind")
    args = p.parse_args()
    import os

    from ddpkit.rank import profiling, steps

    os.environ["RANK"] = "0"
    device = torch.device(args.device)
    model, data = model_and_data(args.model, args.batch, device)
    bf16 = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    folder = Path(tempfile.mkdtemp())
    remove = steps.timed_here(folder / "rank0.steps")
    run_block(model, opt, data, 5, device, bf16)  # warm-up, the last gradient learned
    check_ns = min(timeit.repeat("p.plan is not None", globals={"p": profiling}, number=10**6,
                                 repeat=5)) * 1e3  # fmt: skip
    off, on, export = [], [], []
    for i in range(args.rounds):
        for recording in (False, True) if i % 2 == 0 else (True, False):
            if recording:  # the profiler starts at the end of the next (untimed) step, and
                # the trace is written at the end of the one after the block (untimed too)
                clock = steps.clock()
                assert clock is not None
                out = folder / f"r{i}"
                profiling.plan = profiling.Plan(
                    clock.number + 1, args.steps + 1, str(out), id=str(i)
                )
            run_block(model, opt, data, 1, device, bf16)
            took = run_block(model, opt, data, args.steps, device, bf16)
            run_block(model, opt, data, 1, device, bf16)
            (on if recording else off).append(took)
            if recording:
                summary = json.loads((out / "rank0.summary.json").read_text())
                assert summary["recorded"] == args.steps + 1, summary
                export.append(summary["export_s"])
    remove()
    t_off, t_on = statistics.median(off), statistics.median(on)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# ddpkit profile's cost: {args.model} batch {args.batch} on {device} ({where}), "
          f"{args.rounds} blocks of {args.steps} steps each way, medians")  # fmt: skip
    print(f"nothing armed: {check_ns:.0f} ns a step (one attribute read) = "
          f"{check_ns * 1e-9 / t_off:.5%} of a {t_off * 1e3:.2f} ms step")  # fmt: skip
    print(f"{'not recording':>14} {'recording':>10} {'ratio':>7} {'trace written':>14}")
    print(f"{t_off * 1e3:>12.2f}ms {t_on * 1e3:>8.2f}ms {t_on / t_off:>6.2f}x "
          f"{statistics.median(export):>12.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
