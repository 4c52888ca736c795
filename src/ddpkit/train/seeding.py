"""Seeding: the same seed on every rank for model init (so replicas start equal); data workers
get rank-mixed seeds from ddpkit.train.loaders."""

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
