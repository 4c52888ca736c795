"""A notice, once, when a shuffling DistributedSampler is iterated again at the epoch it had
(`set_epoch` never called): every epoch then sees its samples in the same order, which is
silent in torch and costs accuracy. Installed by the bootstrap when
torch.utils.data.distributed is imported; said by rank 0 only (every rank has the same)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ddpkit.rank import runtime


@dataclass
class Said:
    """Whether the notice was said: a part of the rank's runtime."""

    said: bool = False


def patch_sampler(module: Any) -> None:
    sampler = getattr(module, "DistributedSampler", None)
    original = getattr(sampler, "__iter__", None)
    if original is None or getattr(original, "_ddpkit_watched", False):
        return
    if not runtime.current().is_rank():
        return  # outside ddpkit run, or a child of the rank (a DataLoader worker)

    def watched_iter(self: Any) -> Any:
        told = runtime.current().part(Said)
        epoch = getattr(self, "epoch", None)
        passes = self.__dict__.get("_ddpkit_passes", {})
        passes[epoch] = passes.get(epoch, 0) + 1
        self.__dict__["_ddpkit_passes"] = passes
        if (
            not told.said
            and getattr(self, "shuffle", False)
            and passes[epoch] == 2
            and len(passes) == 1
            and runtime.current().rank_name == "0"
        ):
            told.said = True
            print(
                f"ddpkit: a DistributedSampler starts another pass at epoch {epoch}: "
                "set_epoch(epoch) is never called, so every epoch shuffles its samples the same "
                "way; call sampler.set_epoch(epoch) before each epoch (s.loader() does)",
                file=sys.stderr,
                flush=True,
            )
        return original(self)

    watched_iter._ddpkit_watched = True  # type: ignore[attr-defined]
    sampler.__iter__ = watched_iter  # type: ignore[union-attr]
