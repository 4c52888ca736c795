"""A notice, once, when every rank trains on the whole data set: a DataLoader with no
DistributedSampler (a plain `DataLoader(dataset, shuffle=True)` beside `s.wrap` or DDP) gives
each rank all of the data, so the job does N copies of the same work and an epoch takes N
times the steps it should. torch says nothing; the script ends with exit 0.

Installed by the bootstrap when torch.utils.data.dataloader is imported. Each rank that starts
iterating such a loader while training (gradients on, a process group of more than one) writes
where in its state file `rank<R>.unsharded`; the rank that finds every rank of its node has
written one says it, once (a loader that rank 0 alone iterates, an evaluation on rank 0, is
not the mistake).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.common import protocol
from ddpkit.rank import runtime

UNSHARDED = "unsharded"  # the rank's file: where it iterates a loader with no sharding


@dataclass
class Notice:
    """Whether this rank wrote its file: a part of its runtime."""

    written: bool = False


def patch_loader(module: Any) -> None:
    loader = getattr(module, "DataLoader", None)
    original = getattr(loader, "__iter__", None)
    if original is None or getattr(original, "_ddpkit_watched", False):
        return
    here = runtime.current()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not here.is_rank() or world < 2:
        return  # outside a job of several ranks, or a child of the rank (a loader's worker)
    state_dir, rank = here.state_dir, here.rank_name

    def watched_iter(self: Any) -> Any:
        if not runtime.current().part(Notice).written:
            try:
                _look(self, Path(state_dir), rank, sys._getframe(1))
            except Exception as err:  # never break the script's loop
                from ddpkit.errors import debug_note

                debug_note("watching a DataLoader's sharding", err)
        return original(self)

    watched_iter._ddpkit_watched = True  # type: ignore[attr-defined]
    loader.__iter__ = watched_iter  # type: ignore[union-attr]


def _look(loader: Any, state_dir: Path, rank: str, caller: Any) -> None:
    what = unsharded(loader)
    if what is None:
        return
    import torch
    import torch.distributed as dist

    if not torch.is_grad_enabled() or not dist.is_initialized() or dist.get_world_size() < 2:
        return  # an evaluation, or no job of several ranks
    runtime.current().part(Notice).written = True
    site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    batches = len(loader) if hasattr(loader, "__len__") else 0
    protocol.state_path(state_dir, rank, UNSHARDED).write_text(f"{site}\t{what}\t{batches}\n")
    _say_when_all(state_dir, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                  dist.get_world_size())  # fmt: skip


def unsharded(loader: Any) -> str | None:
    """'RandomSampler over 192 samples' for a map-style loader whose sampler shards nothing;
    None for a DistributedSampler (or any sampler of the script's own), an IterableDataset
    (it shards itself, or not, in ways not seen from here)."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", sampler)
    if type(inner) not in (RandomSampler, SequentialSampler):
        return None
    try:
        size = len(loader.dataset)
    except TypeError:
        return None
    return f"{type(inner).__name__} over {size} samples"


def _say_when_all(state_dir: Path, local: int, world: int) -> None:
    """Said by the rank that finds every rank of its node's file written (the last to write;
    an exclusive create makes it one rank even when two find them at once)."""
    here = [protocol.state_path(state_dir, r, UNSHARDED) for r in _ranks_here(state_dir)]
    written = [p for p in here if p.exists()]
    if len(written) < local:
        return
    try:
        os.close(os.open(state_dir / f"{UNSHARDED}.said", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    site, what, batches = min(written).read_text().rstrip("\n").split("\t")
    steps = f" (each rank iterates all {batches} batches where its share is about "
    steps += f"{-(-int(batches) // world)})" if int(batches) else ")"
    print(
        "ddpkit: every rank iterates the whole data set of the DataLoader iterated at "
        f"{site} ({what}, no DistributedSampler): the job does the same work {world} times"
        f"{steps}; use s.loader(dataset, batch_size=...) (it shards, shuffles and sets "
        "the epoch), or DataLoader(dataset, sampler=DistributedSampler(dataset)) "
        "without shuffle=True and sampler.set_epoch(epoch) before each epoch",
        file=sys.stderr,
        flush=True,
    )


def _ranks_here(state_dir: Path) -> list[str]:
    """The ranks that write in this node's state folder (their phase files)."""
    return [p.name.split(".")[0][4:] for p in state_dir.glob(f"rank*.{protocol.PHASE}")]
