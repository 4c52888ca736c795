"""Where FSDP2's step time goes on one GPU, against the plain model: wall time per step, the GPU's
busy time in it (kernels, from the profiler) and the host's busiest calls, at two batch sizes and
with the variants that could explain a gap (ddpkit's mixed-precision policy or none, fused or
foreach AdamW). A step that is much longer than its kernels is bound by the host (Python and
launches), and the gap then shrinks as the batch grows.

    ddpkit run -n gpu benchmarks/fsdp_overhead.py [--batches 8,32] [--steps 15]

Prints one table last. The model is `ddpkit bench`'s GPT-2-small shape, bf16 autocast.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import ddpkit
from ddpkit.bench.models import gpt
from ddpkit.train import sharding

VARIANTS = {
    # name: (shard, mixed-precision policy, fused AdamW)
    "plain": (False, None, True),
    "fsdp2 (ddpkit)": (True, "bf16", True),
    "fsdp2 no mp": (True, "fp32", True),
    "fsdp2 foreach": (True, "bf16", False),
}


def one(s, variant: str, batch: int, steps: int) -> dict:
    sharded, precision, fused = VARIANTS[variant]
    with torch.device(s.device):
        model, make = gpt(layers=12, width=768, heads=12, seq=1024)
    if sharded:
        model = sharding.shard(model, True, s.place, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    x, y = make(batch, s.device)

    def step() -> None:
        with s.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(5):
        step()
    walls = []
    for _ in range(steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - began)
    host = []
    for _ in range(steps):  # the host's time to issue a step, the GPU drained before each
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        host.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 3
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "host_ms": statistics.median(host) * 1e3,
        "gpu_ms": gpu_us / 1e3,
        "top": [(e.key, e.self_cpu_time_total / 3e3, e.count // 3) for e in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    rows = []
    with ddpkit.setup(seed=0) as s:
        for batch in map(int, args.batches.split(",")):
            for variant in VARIANTS:
                r = one(s, variant, batch, args.steps)
                gc.collect()  # the variant's model and optimizer, gone before the next
                torch.cuda.empty_cache()
                rows.append((batch, variant, r))
                print(f"b{batch} {variant}: host's busiest calls per step:", flush=True)
                for name, ms, count in r["top"]:
                    print(f"    {ms:8.2f} ms  x{count:<5d} {name}", flush=True)
    print(f"{'batch':>5}  {'variant':<16}{'wall ms':>9}{'vs plain':>9}{'host ms':>9}{'GPU ms':>9}")
    base = {b: r["wall_ms"] for b, v, r in rows if v == "plain"}
    for batch, variant, r in rows:
        print(
            f"{batch:>5}  {variant:<16}{r['wall_ms']:9.2f}{r['wall_ms'] / base[batch]:9.3f}"
            f"{r['host_ms']:9.2f}{r['gpu_ms']:9.2f}"
        )


if __name__ == "__main__":
    main()
