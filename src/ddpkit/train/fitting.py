"""A batch that fits, agreed across ranks (`s.fit`, opt-in): each step's batch is split into
micro-batches of an agreed size; when any rank runs out of memory in a step, every rank
discards that step's partial gradients, halves the micro-batch (doubling the accumulation, so
the batch and the optimizer's math are kept) and does the step again, on the same data with
the same random state, without a hang. Said once per change, by rank 0:
`ddpkit: rank 2 ran out of memory at micro-batch 32: every rank now runs 2 x 16`.

Why no rank can hang: the micro-batches run under DDP's no_sync (nothing is exchanged while a
rank may fail), the ranks then agree on whether any failed (one small all-reduce), and only
then are the gradients averaged (each gradient all-reduced in place) and the optimizer steps.
Accelerate's find_executable_batch_size retries in each process alone, so ranks can pick
different sizes and hang; this one never leaves the ranks apart.

The micro-batch is state: `s.save_state(..., fit=fit)` keeps it, so a resumed run goes on at
the size it had reached. The loss a step returns is the batch's (each micro-batch's loss is
weighted by its share of the batch, which is right for losses that average over samples).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.train import comm, sharding
from ddpkit.train.placement import Placement
from ddpkit.train.wrapping import unwrap


class BatchDoesNotFitError(DdpkitError):
    exit_code = 1


class Fit:
    """See the module's docstring. `micro_batch` starts smaller than the batch if given."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        place: Placement,
        micro_batch: int | None = None,
    ) -> None:
        if sharding.is_sharded(unwrap(model)):
            raise ConfigError(
                "s.fit does not take a sharded model: FSDP2 exchanges parameters during the "
                "forward pass, where a rank may run out of memory",
                fix="use s.fit with a DDP model (s.wrap(model)), or shard without s.fit",
            )
        if micro_batch is not None and micro_batch < 1:
            raise ConfigError(f"s.fit(micro_batch={micro_batch})", fix="give 1 or more")
        self.model, self.optimizer, self.place = model, optimizer, place
        self.micro = micro_batch  # None: the whole batch at once
        self.changes: list[tuple[int, int, int]] = []  # (failing rank, old size, new size)

    # -- state, for s.save_state -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"micro": self.micro}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro = state.get("micro")

    # -- a step --------------------------------------------------------------------------

    def step(self, loss_fn: Callable[..., torch.Tensor], *batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward over `batch` in micro-batches, the gradients averaged across
        ranks, the optimizer stepped; the batch's loss (detached). Collective."""
        if not batch:
            raise ConfigError("fit.step(loss_fn) got no batch", fix="fit.step(loss_fn, x, y)")
        size = len(batch[0])
        while True:
            micro = min(self.micro or size, size)
            saved = _rng_state(self.place.device)
            total, failure = self._micro_steps(loss_fn, batch, size, micro)
            # one small all-reduce: the lowest rank that failed, or the world's size if none
            mine = self.place.rank if failure is not None else self.place.world_size
            culprit = int(comm.reduce(mine, self.place, op="min"))
            if culprit == self.place.world_size:
                self._average_gradients()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                return total
            self.optimizer.zero_grad(set_to_none=True)
            _set_rng_state(saved, self.place.device)
            _free(self.place.device)
            if micro == 1:
                raise BatchDoesNotFitError(
                    f"rank {culprit} runs out of memory even one sample at a time",
                    fix="a smaller model per GPU (s.wrap(model, shard=True)), fewer other "
                    "processes on its GPU, or a shorter sequence",
                ) from failure
            self.micro = micro // 2
            steps = -(-size // self.micro)
            self.changes.append((culprit, micro, self.micro))
            if self.place.is_main:
                print(
                    f"ddpkit: rank {culprit} ran out of memory at micro-batch {micro}: every rank "
                    f"now runs {steps} x {self.micro}",
                    file=sys.stderr,
                    flush=True,
                )

    def _micro_steps(
        self, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...], size: int,
        micro: int,
    ) -> tuple[torch.Tensor, BaseException | None]:  # fmt: skip
        total = torch.zeros((), device=self.place.device)
        try:
            with self._no_sync():
                for start in range(0, size, micro):
                    parts = [t[start : start + micro] for t in batch]
                    loss = loss_fn(*parts) * (len(parts[0]) / size)
                    loss.backward()
                    total = total + loss.detach()
        except Exception as err:
            if not _out_of_memory(err):
                raise
            return total, err.with_traceback(None)  # its frames hold the step's tensors
        return total, None

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is None:
            yield
        else:
            with no_sync():
                yield

    def _average_gradients(self) -> None:
        """Every gradient averaged across ranks (DDP exchanged nothing under no_sync)."""
        if self.place.alone or not dist.is_initialized():
            return
        works = [
            dist.all_reduce(p.grad, async_op=True)
            for p in self.model.parameters()
            if p.grad is not None
        ]
        for work in works:
            assert work is not None
            work.wait()
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(self.place.world_size)


def _out_of_memory(err: BaseException) -> bool:
    from ddpkit.rank.oom_facts import is_out_of_memory

    return is_out_of_memory(err) is not None


def _rng_state(device: torch.device) -> tuple[Any, Any]:
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu


def _set_rng_state(state: tuple[Any, Any], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
