"""Where does DDP's step time go? Issue 7's scaling target needs the answer, so this measures,
in one job (steps of every variant interleaved, order alternating, CUDA synchronised around
each step, every step with its optimizer step), the same model trained as:

  bare     the model itself (no DDP; at several ranks: no gradient sync at all, the ceiling)
  raw      DistributedDataParallel(model) with torch's defaults
  wrap     s.wrap(model) (ddpkit's defaults)
  nocomm   s.wrap's DDP with a comm hook that communicates nothing (the reducer's own cost)
  bf16     s.wrap(model, compress="bf16")
  nobb     s.wrap(model, broadcast_buffers=False)
  bNNN     DDP(bucket_cap_mb=NNN, gradient_as_bucket_view=True), e.g. b25, b400

then profiles 3 steps of each (torch.profiler) and prints, per variant, kernel time by kind
per step and the GPU's busy time (union of kernel intervals) against the step's wall time,
and the kernels that take longer than under `bare`.

Run through the launcher: python -m ddpkit run -n N benchmarks/ddp_overhead.py [--steps 20]
Rank 0 prints the table and writes ddp_overhead_<N>.json into $OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.bench.busy import is_kernel, union_us
from ddpkit.bench.models import resolve


def _no_comm_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90", "cublas", "xmma")):
        return "matmul"
    if "flash" in low or "attention" in low or "fmha" in low:
        return "attention"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if "adam" in low or "foreach" in low or "multi_tensor" in low:
        return "optimizer"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="bare,raw,wrap,nocomm,bf16,b25,b400")
    parser.add_argument("--block", type=int, default=1, help="steps per timed block")
    parser.add_argument("--bind", action="store_true", help="pin to the GPU's local cores")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--gc-off", action="store_true", help="gc.freeze() + gc.disable()")
    parser.add_argument("--compile", action="store_true", help="torch.compile every variant")
    args = parser.parse_args()
    with ddpkit.setup(seed=0) as s:
        if args.bind and s.device.type == "cuda":
            _bind_near(s.device.index)
        model, make_batch = resolve(args.model)()
        pristine = copy.deepcopy(model)
        dev = s.device
        ids = [dev.index] if dev.type == "cuda" else None
        multi = s.world_size > 1

        def ddp(**kw: Any) -> nn.Module:
            m = copy.deepcopy(pristine).to(dev)
            return DistributedDataParallel(m, device_ids=ids, **kw) if multi else m

        builders = {
            "bare": lambda: copy.deepcopy(pristine).to(dev),
            "raw": lambda: ddp(),
            "wrap": lambda: s.wrap(copy.deepcopy(pristine)),
            "nocomm": lambda: s.wrap(copy.deepcopy(pristine)),
            "bf16": lambda: s.wrap(copy.deepcopy(pristine), compress="bf16"),
            "nobb": lambda: s.wrap(copy.deepcopy(pristine), broadcast_buffers=False),
        }
        for name in args.variants.split(","):
            if name[0] == "b" and name[1:].isdigit():  # bNNN: bucket_cap_mb=NNN + bucket views
                builders[name] = lambda cap=int(name[1:]): ddp(
                    bucket_cap_mb=cap, gradient_as_bucket_view=True
                )
        names = [v for v in args.variants.split(",") if multi or v in ("bare", "raw")]
        if not multi:
            builders["raw"] = lambda: DistributedDataParallel(
                copy.deepcopy(pristine).to(dev), device_ids=ids
            )
        models = {n: builders[n]() for n in names}
        if "nocomm" in models and multi:
            models["nocomm"].register_comm_hook(None, _no_comm_hook)
        if args.compile:
            models = {n: torch.compile(m) for n, m in models.items()}
        opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
        x, y = make_batch(args.batch, dev)

        def step(n: str) -> None:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = nn.functional.cross_entropy(models[n](x), y)
            loss.backward()
            opts[n].step()
            opts[n].zero_grad(set_to_none=True)

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        for _ in range(3):
            for n in names:
                step(n)
        times: dict[str, list[float]] = defaultdict(list)
        if args.gc_off:
            gc.collect()
            gc.freeze()
            gc.disable()
        gc_spent = _watch_gc()
        for i in range(args.steps):
            for n in names if i % 2 == 0 else reversed(names):
                sync()
                began = time.perf_counter()
                for _ in range(args.block):
                    step(n)
                sync()
                times[n].append((time.perf_counter() - began) / args.block)
        gc.enable()
        gc_ms = sum(gc_spent) * 1e3 / (args.steps * args.block * len(names))
        gc.callbacks.clear()
        profile: dict[str, dict[str, float]] = {}
        diffs: dict[str, list[tuple[str, float]]] = {}
        per_kernel: dict[str, dict[str, float]] = {}
        steps_profiled = 3
        for n in names if not args.no_profile else []:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if dev.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            sync()
            with torch.profiler.profile(activities=activities) as prof:
                began = time.perf_counter()
                for _ in range(steps_profiled):
                    step(n)
                sync()
                wall = (time.perf_counter() - began) / steps_profiled
            kinds: dict[str, float] = defaultdict(float)
            kernels: dict[str, float] = defaultdict(float)
            spans = []
            for ev in prof.events():
                if is_kernel(ev):
                    dur = ev.time_range.end - ev.time_range.start
                    kinds[_kind(ev.name)] += dur / steps_profiled / 1e3
                    kernels[ev.name[:90]] += dur / steps_profiled / 1e3
                    spans.append((ev.time_range.start, ev.time_range.end))
            busy = union_us(spans) / steps_profiled / 1e3
            compute = union_us(
                [
                    (ev.time_range.start, ev.time_range.end)
                    for ev in prof.events()
                    if is_kernel(ev) and "nccl" not in ev.name.lower()
                ]
            )
            profile[n] = {
                "wall_ms": wall * 1e3,
                "busy_ms": busy,
                "compute_busy_ms": compute / steps_profiled / 1e3,
                **{f"{k}_ms": v for k, v in sorted(kinds.items())},
            }
            per_kernel[n] = kernels
        for n in profile:
            if n == "bare":
                continue
            d = {
                k: per_kernel[n].get(k, 0.0) - per_kernel["bare"].get(k, 0.0)
                for k in set(per_kernel[n]) | set(per_kernel["bare"])
            }
            diffs[n] = sorted(d.items(), key=lambda kv: -abs(kv[1]))[:8]
        medians = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        iqr = {n: _iqr(v) * 1e3 for n, v in times.items()}
        everyone: list[Any] = [None] * s.world_size
        if multi:
            dist.all_gather_object(everyone, {"medians": medians, "iqr": iqr, "gc_ms": gc_ms})
        else:
            everyone = [{"medians": medians, "iqr": iqr, "gc_ms": gc_ms}]
        if s.is_main:
            _report(s.world_size, names, everyone, profile, diffs)
            out = Path(os.environ.get("OUT", "."))
            (out / f"ddp_overhead_{s.world_size}.json").write_text(
                json.dumps(
                    {
                        "ranks": s.world_size,
                        "per_rank": everyone,
                        "profile_rank0": profile,
                        "kernel_diff_vs_bare_rank0": diffs,
                    },
                    indent=1,
                )
            )


def _report(
    ranks: int,
    names: list[str],
    everyone: list[Any],
    profile: dict[str, dict[str, float]],
    diffs: dict[str, list[tuple[str, float]]],
) -> None:
    print(f"\n== {ranks} rank(s): step ms per rank (median, IQR), profile of rank 0 per step")
    print("gc ms per step, per rank: " + ",".join(f"{e['gc_ms']:.3f}" for e in everyone))
    kinds = sorted({k for p in profile.values() for k in p if k.endswith("_ms")} - {"wall_ms"})
    head = " ".join(f"{k[:-3]:>9}" for k in kinds)
    print(f"{'variant':<8} {'ranks median':>22} {'IQR':>6} {'wall':>7} {head}")
    for n in names:
        meds = ",".join(f"{e['medians'][n]:.2f}" for e in everyone)
        worst = max(e["iqr"][n] for e in everyone)
        p = profile.get(n, {})
        cols = " ".join(f"{p.get(k, 0.0):9.2f}" for k in kinds)
        print(f"{n:<8} {meds:>22} {worst:6.2f} {p.get('wall_ms', 0.0):7.2f} {cols}")
    for n, rows in diffs.items():
        print(f"-- {n}: kernels vs bare (ms/step)")
        for k, v in rows:
            print(f"   {v:+7.2f}  {k}")
    print(flush=True)


def _watch_gc() -> list[float]:
    """Seconds spent in each garbage collection from now on."""
    spent: list[float] = []
    began = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spent.append(time.perf_counter() - began[0])

    gc.callbacks.append(callback)
    return spent


def _bind_near(index: int) -> None:
    """Pin this process to the CPU cores of its GPU's NUMA node (from sysfs)."""
    props = torch.cuda.get_device_properties(index)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    cpus: set[int] = set()
    text = Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text().strip()
    for part in text.split(","):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    allowed = os.sched_getaffinity(0) & cpus
    print(f"rank on GPU {index} ({bus}): local cpus {text}; pinned to {len(allowed)}", flush=True)
    if allowed:
        os.sched_setaffinity(0, allowed)


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
