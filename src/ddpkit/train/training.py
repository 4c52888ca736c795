"""The training-loop helpers users expect from Accelerate and Fabric, small and explicit:
mixed precision with `s.autocast()`, `s.backward(loss)` and `s.step(optimizer)` (a GradScaler
for fp16, nothing for bf16 or fp32), and `s.clip(model, max_norm)` that unscales first."""

from __future__ import annotations

import contextlib
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
