"""One rank of `ddpkit bench ddp --shard`: the same model trained with DDP (`s.wrap(model)`)
and sharded (`s.wrap(model, shard=True)`, FSDP2), one after the other in the same job: the
median step time, the peak memory, and the bytes each rank holds for parameters, gradients and
optimizer state; with `grow`, the largest model of the family each trains here (layers
doubled, then halved back, until a step no longer fits). Rank 0 prints one
`DDPKIT_SHARD_BENCH {json}` line. `host_ms` is the host's time to issue a step (the GPU
drained before it): near `step_ms`, the step waits on Python (FSDP2's hooks), not on the GPU.

At world size 1, `force` shards anyway (a mesh of one GPU): FSDP2's machinery runs, no memory
can be saved; `ddpkit bench ddp` says so.

`python -m ddpkit.bench.shard_worker CONFIG_JSON` (started by `ddpkit bench ddp --shard`).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import ddpkit
from ddpkit.bench.models import gpt
from ddpkit.train import sharding


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for parameters, their gradients and the optimizer's state."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local(value).numel() * local(value).element_size()
    return total


def trial(s: Any, variant: str, layers: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Steps of one variant; None when it does not fit (on any rank)."""
    model = opt = None
    fits = True
    result: dict[str, Any] = {}
    try:
        with torch.device(s.device):  # built where it runs: a large model's init is quick
            model, make = gpt(layers=layers, width=cfg["width"], heads=cfg["heads"], seq=cfg["seq"])
        if variant == "ddp":
            model = s.wrap(model)
        elif s.world_size == 1 and cfg.get("force"):
            model = sharding.shard(model.to(s.device), True, s.place, "bf16")
        else:
            model = s.wrap(model, shard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=s.device.type == "cuda")
        x, y = make(cfg["batch"], s.device)
        times, issued = [], []
        torch.cuda.reset_peak_memory_stats(s.device)
        for i in range(cfg["warmup"] + cfg["steps"]):
            torch.cuda.synchronize(s.device)
            began = time.perf_counter()
            with s.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            host_done = time.perf_counter()  # the host has issued the whole step
            torch.cuda.synchronize(s.device)
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - began)
                issued.append(host_done - began)
        result = {
            "step_ms": s.reduce(statistics.median(times), op="max") * 1e3,
            # a step whose host time is (nearly) all of it waits on Python, not on the GPU
            "host_ms": s.reduce(statistics.median(issued), op="max") * 1e3,
            "peak_mib": s.reduce(torch.cuda.max_memory_allocated(s.device) / 2**20, op="max"),
            "held_mib": s.reduce(held_bytes(model, opt) / 2**20, op="max"),
            "params": sum(
                (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
            ),
        }
    except torch.OutOfMemoryError:
        fits = False
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    fits = bool(s.reduce(int(fits), op="min"))  # every rank agrees, or none goes on
    return result if fits else None


def largest(s: Any, variant: str, cfg: dict[str, Any]) -> int:
    """The most layers (of the bench's GPT family) this variant trains here."""
    low, high = cfg["layers"], None
    layers = cfg["layers"]
    while high is None and layers <= cfg["max_layers"]:
        if trial(s, variant, layers, {**cfg, "steps": 1, "warmup": 1}) is None:
            high = layers
        else:
            low, layers = layers, layers * 2
    if high is None:
        return low
    while high - low > max(1, low // 8):
        mid = (low + high) // 2
        if trial(s, variant, mid, {**cfg, "steps": 1, "warmup": 1}) is None:
            high = mid
        else:
            low = mid
    return low


def main(config_json: str) -> int:
    cfg = json.loads(config_json)
    with ddpkit.setup(seed=0) as s:
        if s.device.type != "cuda":
            raise SystemExit("ddpkit bench ddp --shard measures GPU memory: run it on GPUs")
        rows = {v: trial(s, v, cfg["layers"], cfg) for v in ("ddp", "sharded")}
        grown = {v: largest(s, v, cfg) for v in ("ddp", "sharded")} if cfg.get("grow") else {}
        if s.is_main:
            body = {"ranks": s.world_size, "layers": cfg["layers"], "rows": rows, "grown": grown}
            print("DDPKIT_SHARD_BENCH " + json.dumps(body), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
