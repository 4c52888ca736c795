"""The training-loop helpers users expect from Accelerate and Fabric, small and explicit:
mixed precision with `s.autocast()`, `s.backward(loss)` and `s.step(optimizer)` (a GradScaler
for fp16, nothing for bf16 or fp32), `s.clip(model, max_norm)` that unscales first, and
gradient accumulation (`s.accumulate`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.errors import ConfigError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


class Precision:
    """What autocast does on this device, and the GradScaler fp16 needs."""

    def __init__(self, device: torch.device, precision: str = "auto") -> None:
        if precision not in PRECISIONS:
            raise ConfigError(
                f"precision {precision!r} is not one of {PRECISIONS}",
                fix="use 'auto' (bf16 on GPUs, fp32 on CPU), 'bf16', 'fp16' or 'fp32'",
            )
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "fp32"
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError(
                "fp16 autocast needs a GPU; this rank runs on the CPU",
                fix="use precision='bf16' or 'fp32' on the CPU",
            )
        self.device = device
        self.precision = precision
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self._unscaled: set[int] = set()

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.precision == "fp32":
            yield
            return
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        # a CUDA graph capture must not keep autocast's cache of cast weights (they would be
        # stale on replay), as PyTorch's CUDA-graphs notes say
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        with torch.autocast(self.device.type, dtype=dtype, cache_enabled=not capturing):
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)

    def clip(self, model: torch.nn.Module, max_norm: float, optimizer: Any = None) -> torch.Tensor:
        """Clip the gradients' global norm to max_norm (after unscaling them, with fp16)."""
        if self.scaler is not None:
            if optimizer is None:
                raise ConfigError(
                    "s.clip(model, max_norm) with fp16 needs the optimizer, to unscale first",
                    fix="call s.clip(model, max_norm, optimizer)",
                )
            if id(optimizer) not in self._unscaled:
                self.scaler.unscale_(optimizer)
                self._unscaled.add(id(optimizer))
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def step(self, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))


@dataclasses.dataclass
class Step:
    """One micro-step inside `Session.accumulate`: `sync` is True on the step that should
    call optimizer.step()."""

    index: int
    sync: bool


class MicroSteps:
    """Gradient accumulation: each model's micro-step count; gradients are synchronised only
    on every `every`-th micro-step (DDP's no_sync, FSDP2's requires_gradient_sync)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    @contextlib.contextmanager
    def step(self, model: torch.nn.Module, every: int) -> Iterator[Step]:
        from ddpkit.train import sharding
        from ddpkit.train.wrapping import unwrap

        if every < 1:
            raise ConfigError(
                f"accumulate(every={every}) must be at least 1",
                fix="pass every=1 for no accumulation, or the micro-step count",
            )
        count = self.counts.get(id(model), 0) + 1
        self.counts[id(model)] = count
        step = Step(index=count, sync=count % every == 0)
        inner = unwrap(model)
        if sharding.is_sharded(inner):  # FSDP2: no no_sync(), a switch on the module
            inner.set_requires_gradient_sync(step.sync)  # type: ignore[operator]
            yield step
            return
        no_sync = getattr(model, "no_sync", None)
        if step.sync or no_sync is None:
            yield step
        else:
            with no_sync():
                yield step
