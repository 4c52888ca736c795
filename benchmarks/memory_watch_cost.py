"""What the memory doctor costs a rank (issue 29: the watch at most 0.5% of a step when nothing
fails), measured in one run, GPT-2-small bf16 on one GPU:

* the watch: a step's end reads what torch holds (allocated, peak, reserved: what
  ddpkit.rank.steps reads, at most every MEMORY_EVERY seconds) and writes it to the rank's
  step record, which the launcher reads; blocks of steps with it alternate with blocks
  without it;
* `--memory-snapshot`: torch's allocator history (`_record_memory_history`, 100,000 entries,
  Python stacks, as ddpkit run sets it), on against off the same way, and with torch's
  default of C++ stacks too;
* the host cost of the watch's reads alone, in microseconds, over many calls.

    python benchmarks/memory_watch_cost.py --batch 8

Medians of the blocks; the paired column is the median of each pair's difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_timing_cost import model_and_data, run_block  # noqa: E402

from ddpkit.common import protocol  # noqa: E402
from ddpkit.rank.steps import MEMORY_EVERY, gpu_memory  # noqa: E402


def watched(step_end):
    """Wrap the optimizer's step so each step ends as ddpkit's does: the memory read and
    written to the step record."""
    writer = protocol.StepWriter(Path(tempfile.mkdtemp()) / "rank0.steps")
    read_at = [-MEMORY_EVERY]

    def hook(*_):
        now = time.perf_counter()
        if now - read_at[0] >= MEMORY_EVERY:
            read_at[0] = now
            writer.set_memory(*gpu_memory(torch.cuda))

    return step_end.register_step_post_hook(hook)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--rounds", type=int, default=30, help="blocks of each kind")
    args = p.parse_args()
    device = torch.device("cuda")
    model, data = model_and_data("gpt", args.batch, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run_block(model, opt, data, args.steps, device, True)  # warm-up
    results = {}
    for name in ("watch", "history", "history-all"):
        off, on = [], []
        for i in range(args.rounds):  # alternate which goes first, so drift hits both alike
            for with_it in (False, True) if i % 2 == 0 else (True, False):
                handle = None
                if with_it and name == "watch":
                    handle = watched(opt)
                elif with_it:  # as ddpkit.rank.oom_facts.start_history records it
                    stacks = "all" if name == "history-all" else "python"
                    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks=stacks)
                run_block(model, opt, data, 2, device, True)
                took = run_block(model, opt, data, args.steps, device, True)
                (on if with_it else off).append(took)
                if handle is not None:
                    handle.remove()
                elif with_it:
                    torch.cuda.memory._record_memory_history(enabled=None)
        results[name] = (off, on)
    reads = 5000
    began = time.perf_counter()
    for _ in range(reads):
        gpu_memory(torch.cuda)
    read_us = (time.perf_counter() - began) / reads * 1e6
    print(f"# memory doctor cost: GPT-2-small bf16 batch {args.batch} on "
          f"{torch.cuda.get_device_name()}, {args.rounds} blocks of {args.steps} steps each "
          "way, medians")  # fmt: skip
    print(f"{'what':<28} {'without':>10} {'with':>10} {'cost':>8} {'paired':>8}")
    for name, label in (("watch", "memory watch (every step)"),
                        ("history", "--memory-snapshot history"),
                        ("history-all", "  the same with C++ stacks")):  # fmt: skip
        off, on = results[name]
        t_off, t_on = statistics.median(off), statistics.median(on)
        paired = statistics.median(b - a for a, b in zip(off, on, strict=True)) / t_off
        print(f"{label:<28} {t_off * 1e3:>8.2f}ms {t_on * 1e3:>8.2f}ms "
              f"{(t_on - t_off) / t_off:>+8.2%} {paired:>+8.2%}")  # fmt: skip
    t_step = statistics.median(results["watch"][0])
    share = read_us / (max(t_step, MEMORY_EVERY) * 1e6)
    print(f"# one read of torch's memory figures: {read_us:.1f} us of host time, made at most "
          f"every {MEMORY_EVERY} s: {share:.4%} of this step's host time at worst")  # fmt: skip


if __name__ == "__main__":
    main()
