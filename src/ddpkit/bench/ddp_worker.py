"""One rank of `ddpkit bench ddp`: training steps of `s.wrap(model)` and of a hand-written
`DistributedDataParallel(model)` interleaved step by step in the same job on the same GPU (so
machine noise hits both alike), plus steps under `no_sync` for the exposed communication.
Rank 0 prints one `DDPKIT_DDP_BENCH {json}` line.

`python -m ddpkit.bench.ddp_worker CONFIG_JSON` (started by `ddpkit bench ddp` through the
launcher). CONFIG_JSON: model, batch, steps, warmup, precision, compile, frameworks, graphs,
and `extra_ddp` ({name: DDP keyword arguments}: more hand-written DDP variants, timed with
the others; benchmarks/ddp_defaults.py uses it)."""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.bench.busy import compute_seconds_per_step
from ddpkit.bench.models import resolve


def main(config_json: str) -> int:
    cfg = json.loads(config_json)
    with ddpkit.setup(seed=0, graphs=cfg.get("graphs", False)) as s:
        model, make_batch = resolve(cfg["model"])()
        params = sum(p.numel() for p in model.parameters())
        pristine = copy.deepcopy(model)
        device_ids = [s.device.index] if s.device.type == "cuda" else None

        def raw_ddp(**kwargs: Any) -> nn.Module:
            return DistributedDataParallel(
                copy.deepcopy(pristine).to(s.device), device_ids=device_ids, **kwargs
            )

        models: dict[str, Any] = {"wrap": s.wrap(model), "raw": raw_ddp()}
        for name, kwargs in cfg.get("extra_ddp", {}).items():
            models[name] = raw_ddp(**kwargs)
        if cfg["compile"]:
            models = {k: torch.compile(m) for k, m in models.items()}
        variants: dict[str, Any] = {
            k: _Trainer(m, s.device, cfg["precision"]) for k, m in models.items()
        }
        unavailable = {}
        for name, build in (("accelerate", _accelerate), ("fabric", _fabric)):
            if name in cfg.get("frameworks", []):
                try:
                    variants[name] = build(copy.deepcopy(pristine), s, cfg["precision"])
                except Exception as err:  # not installed, or it refused this set-up
                    unavailable[name] = f"{type(err).__name__}: {err}"[:200]
        x, y = make_batch(cfg["batch"], s.device)
        if cfg.get("graphs"):
            variants["graphed"] = _GraphedTrainer(s, copy.deepcopy(pristine), x, y, cfg)
        for _ in range(cfg["warmup"]):
            for trainer in variants.values():
                trainer.step(x, y, sync=True)
            variants["wrap"].step(x, y, sync=False)
        names = [*variants, "no_sync"]
        times: dict[str, list[float]] = {k: [] for k in names}
        for i in range(cfg["steps"]):
            for name in names if i % 2 == 0 else reversed(names):  # alternate the order too
                trainer = variants["wrap" if name == "no_sync" else name]
                sync = name != "no_sync"
                times[name].append(_timed(partial(trainer.step, x, y, sync=sync), s.device))
        # back to back, as training runs: no wait between steps; each step's time is the GPU's
        # time between CUDA events at its boundaries (idle time waiting for the host included)
        steady = {}
        if cfg.get("graphs") and s.device.type == "cuda":
            for name in ("graphed", "wrap"):
                ms = _back_to_back_ms(variants[name], x, y, cfg["steps"])
                median = s.reduce(statistics.median(ms), op="max")
                steady[name] = {
                    "step_ms": median,
                    "p90_over_median": s.reduce(_p90(ms), op="max") / median,
                }
        busy = None
        if s.device.type == "cuda":
            kernels = compute_seconds_per_step(lambda: variants["wrap"].step(x, y, sync=True))
            busy = s.reduce(kernels / statistics.median(times["wrap"]), op="min")
        medians = {k: s.reduce(statistics.median(v), op="max") for k, v in times.items()}
        spread = {k: s.reduce(_iqr(v), op="max") for k, v in times.items()}
        p90 = {k: s.reduce(_p90(v), op="max") for k, v in times.items()}
        peak = (
            torch.cuda.max_memory_allocated(s.device) // 2**20 if s.device.type == "cuda" else None
        )
        tokens = x.numel() if x.dtype == torch.long else None
        if s.is_main:
            step = medians["wrap"]
            print(
                "DDPKIT_DDP_BENCH "
                + json.dumps(
                    {
                        "ranks": s.world_size,
                        "backend": s.backend,
                        "params": params,
                        "step_ms": step * 1e3,
                        "step_iqr_ms": spread["wrap"] * 1e3,
                        "raw_ddp_step_ms": medians["raw"] * 1e3,
                        "no_sync_step_ms": medians["no_sync"] * 1e3,
                        "exposed_comm_ms": max(0.0, (step - medians["no_sync"]) * 1e3)
                        if s.world_size > 1
                        else 0.0,
                        "wrap_over_raw": step / medians["raw"],
                        "samples_per_s": cfg["batch"] * s.world_size / step,
                        "tokens_per_s": tokens * s.world_size / step if tokens else None,
                        "peak_mib": peak,
                        "gpu_busy": busy,
                        "wrapped_as": type(models["wrap"]).__name__,
                        "variants": {
                            k: {
                                "step_ms": medians[k] * 1e3,
                                "iqr_ms": spread[k] * 1e3,
                                "p90_over_median": p90[k] / medians[k],
                                "over_raw": medians[k] / medians["raw"],
                            }
                            for k in variants
                        },
                        "back_to_back": steady,
                        "unavailable": unavailable,
                    }
                ),
                flush=True,
            )
    return 0


class _Trainer:
    def __init__(self, model: nn.Module, device: torch.device, precision: str) -> None:
        self.model: Any = model
        self.backward: Any = None
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.device = device
        self.bf16 = precision == "bf16"

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        no_sync = getattr(self.model, "no_sync", None)
        skip = no_sync() if (not sync and no_sync is not None) else contextlib.nullcontext()
        with skip:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = nn.functional.cross_entropy(self.model(x), y)
            if self.backward is not None:
                self.backward(loss)
            else:
                loss.backward()
        self.opt.step()  # under no_sync too: exposed comm compares the same work
        self.opt.zero_grad(set_to_none=True)


def _accelerate(model: nn.Module, s: Any, precision: str) -> _Trainer:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no")
    trainer = _Trainer(model.to(s.device), s.device, "fp32")  # autocast is Accelerate's
    trainer.model, trainer.opt = accelerator.prepare(trainer.model, trainer.opt)
    return trainer


def _fabric(model: nn.Module, s: Any, precision: str) -> _Trainer:
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator=s.device.type,
        devices=s.env.local_world_size,
        num_nodes=s.env.nnodes,
        strategy="ddp" if s.world_size > 1 else "auto",
        precision="bf16-mixed" if precision == "bf16" else "32-true",
    )
    fabric.launch()  # started by ddpkit run: Fabric joins the existing group
    trainer = _Trainer(model, s.device, "fp32")  # autocast is Fabric's
    trainer.model, trainer.opt = fabric.setup(trainer.model, trainer.opt)
    trainer.backward = fabric.backward
    return trainer


def _timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds for one step, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


class _GraphedTrainer:
    """s.wrap's model with its whole step (forward, backward, all-reduce, AdamW) as a CUDA
    graph (s.graph); AdamW keeps its state on the GPU (capturable=True)."""

    def __init__(self, s: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: Any):
        self.model = s.wrap(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, capturable=True)
        bf16 = cfg["precision"] == "bf16"

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
                loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return loss.detach()

        self.graphed = s.graph(step, x, y, model=self.model, optimizer=self.opt)

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> None:
        self.graphed(x, y)


def _back_to_back_ms(trainer: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    for _ in range(3):
        trainer.step(x, y, sync=True)
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        trainer.step(x, y, sync=True)
        marks[i + 1].record()
    torch.cuda.synchronize()
    return [marks[i].elapsed_time(marks[i + 1]) for i in range(steps)]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
