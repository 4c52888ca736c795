"""What ddpkit's DDP communication hook costs (ddpkit.train.bucket_layout: the first step
summed in the layout DDP rebuilds to, then torch's allreduce_hook per bucket): a hand-written
DDP against the same DDP with the hook, blocks of steps interleaved in one job, each block
timed end to end (synchronised), medians. GPT-2-small shape, bf16, AdamW, s.wrap's bucket size.

    ddpkit run -n gpu benchmarks/bucket_hook_cost.py     # every GPU; one GPU: DDP of one rank

At world size 1 DDP still buckets gradients and calls the hook per bucket, so the hook's own
cost (a Python call, a division, an all-reduce launch per bucket) is what one GPU measures.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.bench.models import gpt
from ddpkit.train import bucket_layout


def block(model, opt, x, y, steps: int) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps


def main() -> None:
    with ddpkit.setup(seed=0) as s:
        base, make = gpt()
        x, y = make(8, s.device)
        kwargs = {"device_ids": [s.device.index], "bucket_cap_mb": 100}
        plain = DistributedDataParallel(copy.deepcopy(base).to(s.device), **kwargs)
        hooked = DistributedDataParallel(copy.deepcopy(base).to(s.device), **kwargs)
        assert bucket_layout.install(hooked)
        opts = {
            "plain": torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True),
            "hooked": torch.optim.AdamW(hooked.parameters(), lr=1e-4, fused=True),
        }
        models = {"plain": plain, "hooked": hooked}
        for name in models:  # warm-up, and DDP's bucket rebuild
            block(models[name], opts[name], x, y, 5)
        times: dict[str, list[float]] = {"plain": [], "hooked": []}
        for i in range(12):
            for name in ("plain", "hooked") if i % 2 == 0 else ("hooked", "plain"):
                times[name].append(block(models[name], opts[name], x, y, 10))
        p, h = statistics.median(times["plain"]), statistics.median(times["hooked"])
        buckets = len(hooked.reducer._get_zeros_like_grad_buckets())
        s.print(f"# DDP communication hook cost, {s.world_size} rank(s), {buckets} buckets, b8")
        s.print(f"{'plain DDP':>10} {'hooked':>10} {'cost':>8}")
        s.print(f"{p * 1e3:8.2f}ms {h * 1e3:8.2f}ms {(h - p) / p:+8.2%}")


if __name__ == "__main__":
    main()
