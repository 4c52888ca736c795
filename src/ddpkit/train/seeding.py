"""Seeding: the same seed on every rank for model init (so replicas start equal); `mix` makes
one seed of several numbers (a rank's data workers, a batch's reads, a rank's streams re-seeded
after a change of world size)."""

from __future__ import annotations

import random


def seed_everything(seed: int) -> None:
    """Seed Python's random, numpy (when installed) and torch (CPU and every GPU)."""
    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def mix(*parts: int) -> int:
    value = 17
    for part in parts:
        value = (value * 1_000_003 + int(part) * 7919 + 1) % (2**63)
    return value
