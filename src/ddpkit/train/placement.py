"""Where this process stands in the job, frozen at `setup()`: its rank, local rank and the
world's size, the backend and the device, the seed. Every helper of the session takes one
`Placement` instead of the five values in its own order."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str = "gloo"
    device: torch.device = torch.device("cpu")
    seed: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def alone(self) -> bool:
        return self.world_size == 1

    @property
    def comm_device(self) -> torch.device:
        """Where tensors of object collectives live: the GPU under NCCL, the CPU under gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")
